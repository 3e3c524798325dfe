"""Synchronous control calls to a vLLM server (/health, /v1/models, /reset_prefix_cache,
/metrics, the runtime adapter endpoints between runs), where timing does not matter: httpx.
A server that does not answer raises ``Unreachable``."""

from __future__ import annotations

import time
from typing import Any

import httpx

from kvfuzz.traces.errors import InfraError, Unreachable

from .. import metrics as prom
from .wire import LOAD_ADAPTER_PATH, RESET_PATH, HttpTarget, adapter_request, error_text, redact_url, scored_positions


def _client(timeout: float = 10.0) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


def health(base_url: str, timeout: float = 2.0) -> bool:
    try:
        with _client(timeout) as c:
            return c.get(base_url.rstrip("/") + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def list_models(target: HttpTarget) -> list[dict[str, Any]]:
    try:
        with _client() as c:
            r = c.get(target.url("/v1/models"), headers=target.headers())
    except httpx.HTTPError as e:
        raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
    if r.status_code in (401, 403):
        raise InfraError(f"{redact_url(target.base_url)}/v1/models: HTTP {r.status_code} (wrong or missing API key: "
                         f"--api-key or KVFUZZ_API_KEY)")
    if r.status_code != 200:
        raise InfraError(f"{redact_url(target.base_url)}/v1/models: {error_text(r.status_code, r.content)}")
    try:
        return list(r.json().get("data") or [])
    except (ValueError, AttributeError):
        raise InfraError(f"{redact_url(target.base_url)}/v1/models: not an OpenAI model list") from None


def served_adapters(target: HttpTarget) -> dict[str, str]:
    """The LoRA adapters the server serves: name -> path (``root`` in /v1/models)."""
    return {str(m["id"]): str(m.get("root") or "") for m in list_models(target) if m.get("id") and m.get("parent")}


def adapter_call(target: HttpTarget, kind: str, name: str, path: str | None = None) -> tuple[int, str]:
    """One runtime adapter call (``kind`` as a trace event: load-adapter, reload-adapter,
    unload-adapter): (HTTP status, error text or ""). See ``wire.adapter_request``."""
    endpoint, body = adapter_request(kind, name, path)
    try:
        with _client(300.0) as c:
            r = c.post(target.url(endpoint), json=body, headers=target.headers())
    except httpx.HTTPError as e:
        raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
    return r.status_code, "" if r.status_code == 200 else error_text(r.status_code, r.content)


def runtime_lora_status(target: HttpTarget) -> int:
    """The HTTP status of a harmless POST /v1/load_lora_adapter (empty name and path): 404 or
    405 when the server has no runtime adapter endpoints (started without
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True); vLLM with them answers 400 (name and path missing)."""
    try:
        with _client() as c:
            r = c.post(target.url(LOAD_ADAPTER_PATH), json={"lora_name": "", "lora_path": ""},
                       headers=target.headers())
    except httpx.HTTPError as e:
        raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
    return r.status_code


def reset_prefix_cache(target: HttpTarget, *, attempts: int = 50, wait_s: float = 0.1,
                       reset_external: bool = False) -> bool | None:
    """POST /reset_prefix_cache (vLLM dev mode). True: reset. None: the endpoint does not exist
    (or is not allowed). False: the server kept refusing (blocks still held).
    ``reset_external``: also empty the KV connector's cache."""
    params = {"reset_external": "true"} if reset_external else None
    with _client() as c:
        for _ in range(attempts):
            try:
                r = c.post(target.url("/reset_prefix_cache"), headers=target.headers(), params=params)
            except httpx.HTTPError as e:
                raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
            if r.status_code in (404, 405, 401, 403):
                return None
            if r.status_code == 200:
                try:
                    ok = bool(r.json().get("success", True))
                except ValueError:
                    ok = True
                if ok:
                    return True
            time.sleep(wait_s)
    return False


def reset_route_params(target: HttpTarget) -> frozenset[str] | None:
    """The query parameters the server's POST /reset_prefix_cache declares, read from its OpenAPI
    document (FastAPI's /openapi.json, on unless the server runs with --disable-fastapi-docs): an
    unknown query parameter is ignored, not refused, so this is how to tell a release that
    takes ``reset_running_requests`` from one that would silently reset an idle cache only.
    Empty: the document has no such route. None: no document (unknown)."""
    try:
        with _client() as c:
            r = c.get(target.url("/openapi.json"), headers=target.headers())
    except httpx.HTTPError as e:
        raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        return None
    try:
        route = ((r.json().get("paths") or {}).get(RESET_PATH) or {}).get("post")
    except (ValueError, AttributeError):
        return None
    if not isinstance(route, dict):
        return frozenset()
    return frozenset(str(p.get("name")) for p in route.get("parameters") or []
                     if isinstance(p, dict) and p.get("in") == "query")


def wait_idle(target: HttpTarget, *, timeout_s: float = 30.0) -> bool:
    """Wait until /metrics shows no running or waiting request (cancelled streams are aborted
    asynchronously by the server). True if idle (or no metrics), False on timeout."""
    deadline = time.monotonic() + timeout_s
    with _client() as c:
        while True:
            try:
                r = c.get(target.url("/metrics"), headers=target.headers())
            except httpx.HTTPError as e:
                raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
            if r.status_code != 200:
                return True
            n = prom.busy(prom.summarize(r.text))
            if n is None or n == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)



async def scrape(target: HttpTarget) -> dict[str, float]:
    """/metrics summary, or {} when the server exposes none (not an error: a URL may hide it)."""
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            r = await client.get(target.url("/metrics"), headers=target.headers())
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    return prom.summarize(r.text)


def score(target: HttpTarget, prompt: list[int], tokens: list[int], *, adapter: str | None,
          cache_salt: str | None = None, timeout_s: float = 300.0) -> list[list[tuple[int, float]]]:
    """Teacher forcing through /v1/completions: ``prompt`` + ``tokens`` as one prompt with
    ``prompt_logprobs`` (a vLLM extension; non-streaming), one token generated. Per scored
    token: its logprob first, then the best other token's (traces.history.Scoring)."""
    body: dict[str, Any] = {"model": target.model_for(adapter), "prompt": prompt + tokens, "max_tokens": 1,
                            "temperature": 0.0, "prompt_logprobs": 2, "stream": False}
    if cache_salt:
        body["cache_salt"] = cache_salt
    try:
        with _client(timeout_s) as c:
            r = c.post(target.url("/v1/completions"), json=body, headers=target.headers())
    except httpx.HTTPError as e:
        raise Unreachable(f"{redact_url(target.base_url)} does not answer: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise InfraError(f"teacher-forced scoring failed: {error_text(r.status_code, r.content)}")
    try:
        rows = r.json()["choices"][0]["prompt_logprobs"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise InfraError("teacher-forced scoring: the server returned no prompt_logprobs") from None
    return scored_positions(rows, len(prompt), tokens)
