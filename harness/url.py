"""The Engine protocol over a vLLM server kvfuzz does not manage (``--base-url``).

kvfuzz cannot choose this server's flags or restart it: the trace's engine configuration is
only a description, toggles cannot be applied, and the model name comes from ``/v1/models``
unless given. The API key (``--api-key`` / ``KVFUZZ_API_KEY``) lives only in request headers.

References must not reuse KV cached by the runs. In order of preference: the server's
``POST /reset_prefix_cache`` (vLLM dev mode), else a fresh ``cache_salt`` per run and per
reference (a salted request cannot hit blocks cached under another salt), else nothing —
and the finding says so (``reference_note``). A send's own ``cache_salt`` (tenant separation
within a trace) is joined to that isolation salt as ``isolation:own`` (``wire.combine_salts``):
tenants stay apart within a run, and no run or reference shares blocks with another.

A trace's ``reset-prefix-cache`` events need that endpoint as well (refused, exit 2, naming the
event, on a server without it), and one with ``reset_running_requests`` a route whose OpenAPI
document declares the parameter (harness/http/engine.py ``_require_resets``).

Adapter lifecycle events use the server's runtime endpoints (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``), which vLLM serves only when started with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; without them a lifecycle trace is refused (exit 2,
like toggles: the trace asks for what this server cannot do). Adapter sources are paths on
this machine: the server must be able to read them. After a run, the adapter names it changed
are put back as /v1/models listed them when kvfuzz first connected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvfuzz.traces import EngineConfig, Environment, History, RequestRecord, SendEvent, Trace, expand
from kvfuzz.traces.calibration import NoiseKey
from kvfuzz.traces.errors import BadInput, InfraError, Unreachable
from kvfuzz.traces.history import StopAtFlip, TopLogprobs
from kvfuzz.traces.trace import Binding

from .base import EngineKind, reference_config
from .http import control
from .http.engine import HttpEngineBase
from .http.replay import replay_trace
from .http.wire import LOAD_ADAPTER_PATH, HttpTarget, new_salt, redact_url
from .vllm_args import RUNTIME_LORA_ENV


class UrlEngine(HttpEngineBase):
    kind: EngineKind = "url"

    def __init__(self, config: EngineConfig, base_url: str, *, api_key: str | None = None, model: str | None = None,
                 request_timeout_s: float = 300.0):
        if not base_url.startswith(("http://", "https://")):
            raise BadInput(f"not an http(s) URL: {base_url!r}", field="--base-url")
        self.config = config
        self.base_url = base_url.rstrip("/")
        self.shown_url = redact_url(self.base_url)  # for messages: no user:password
        self._api_key = api_key
        self._model = model
        self.request_timeout_s = request_timeout_s
        self.target: HttpTarget | None = None
        self.models: list[str] = []
        self.reference_isolation = "unknown"
        # LoRA adapters served when kvfuzz connected (name -> path), restored after each run.
        self.adapters: dict[str, str] = {}
        self._runtime_lora: bool | None = None  # the runtime adapter endpoints exist (probed once)
        self._runtime_lora_status = 0

    def start(self) -> "UrlEngine":
        if self.target is not None:
            return self
        probe = HttpTarget(self.base_url, self._model or "", api_key=self._api_key)
        served = control.list_models(probe)
        self.models = [str(m.get("id")) for m in served if m.get("id")]
        self.adapters = {str(m["id"]): str(m.get("root") or "") for m in served if m.get("id") and m.get("parent")}
        if self._model is None:
            # Base models have no parent; LoRA adapters name theirs.
            bases = [str(m["id"]) for m in served if m.get("id") and not m.get("parent")]
            if not bases:
                raise InfraError(f"{self.shown_url}/v1/models lists no base model; pass --model")
            self._model = bases[0]
        elif self._model not in self.models:
            raise BadInput(f"model {self._model!r} is not served at {self.shown_url} (serves {self.models})",
                           field="--model")
        self.target = HttpTarget(self.base_url, self._model, api_key=self._api_key)
        self.reference_isolation = self._probe_isolation()
        return self

    def _probe_isolation(self) -> str:
        assert self.target is not None
        if control.reset_prefix_cache(self.target, attempts=3) is not None:
            return "reset_prefix_cache"
        # Does the server accept cache_salt? One token of a short prompt tells.
        from kvfuzz.traces import At, TokenPrompt

        probe = SendEvent(request_id="kvfuzz-probe", at=At(offset_ms=0), prompt=TokenPrompt(token_ids=[16, 17, 18, 19]),
                          max_tokens=1, stream=False)
        hist, errors = replay_trace(self.target, self._alone_trace(self.config, probe, 1), engine="url",
                                       arm="probe", cache_salt=new_salt("probe"), timeout_s=self.request_timeout_s)
        if errors:
            raise Unreachable(f"{self.shown_url} does not answer: {errors[0]}")
        rec = hist.requests["kvfuzz-probe"]
        if rec.error is None:
            return "cache_salt"
        if rec.http_status == 400 and "salt" in (rec.error or "").lower():
            return "none"
        raise InfraError(f"{self.shown_url}: a one-token completion failed: {rec.error}")

    def reference_engine(self) -> "UrlEngine":
        if reference_config(self.config) is not self.config:
            raise BadInput("the server at the URL runs speculative decoding as its trace says; a request's reference "
                           "needs an engine without it: replay in-process or with --engine server",
                           field="engine.speculative")
        return self

    def close(self) -> None:
        self.target = None
        self._drop_adapter_workdir()

    def _initial_adapters(self) -> dict[str, str]:
        return dict(self.adapters)

    def _embeds_model(self, trace: Trace, send: SendEvent) -> str | None:
        """This server's model is kvfuzz's only where the trace names the embedded default: that
        model is built deterministically, so the local copy's table is the server's (the server
        must serve it). Any other model's table is not known here."""
        from kvfuzz.traces import EMBEDDED_MODEL

        from .embedded import resolve_model

        if trace.engine.model != EMBEDDED_MODEL:
            raise BadInput(f"prompt embeddings are built from the model's embedding table, which kvfuzz has for "
                           f"{EMBEDDED_MODEL} only, not {trace.engine.model!r} (a --base-url server's model); "
                           f"replay it in-process or on a managed server (--engine server)",
                           field=f"events[{send.request_id}].embeds")
        # The model alone: the trace's adapters are the server's business.
        engine = trace.engine.model_copy(update={"lora": trace.engine.lora.model_copy(update={"enabled": False})})
        return resolve_model(engine).model_path

    def _reset_missing(self) -> str | None:
        if self.reference_isolation == "reset_prefix_cache":  # it answered the probe at start
            return None
        return f"{self.shown_url} does not serve it (vLLM does only when started with VLLM_SERVER_DEV_MODE=1)"

    def _server_name(self) -> str:
        return self.shown_url

    def _require_runtime_lora(self) -> None:
        """Refuse (exit 2, one line) when the server has no runtime adapter endpoints."""
        assert self.target is not None
        if self._runtime_lora is None:
            status = control.runtime_lora_status(self.target)
            self._runtime_lora = status not in (404, 405)
            self._runtime_lora_status = status
        if not self._runtime_lora:
            raise BadInput(f"adapter lifecycle events need a vLLM server started with {RUNTIME_LORA_ENV}=True; "
                           f"{self.shown_url} answers HTTP {self._runtime_lora_status} to POST {LOAD_ADAPTER_PATH}")

    def __enter__(self) -> "UrlEngine":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compatible(self, config: EngineConfig) -> bool:
        # One server whatever the trace says; its configuration is described, not applied.
        return True

    def _check(self, hist: History, errors: list[str], what: str) -> None:
        if errors and all(r.error and r.error.startswith("connection failed") for r in hist.requests.values()):
            raise Unreachable(f"{self.shown_url} stopped answering during {what}: {errors[0]}")
        if errors and not control.health(self.base_url):
            raise Unreachable(f"{self.shown_url} stopped answering during {what}: {errors[0]}")

    def replay(self, trace: Trace, *, arm: str = "default", run_index: int = 0,
               toggles: Iterable[str] | None = None, until: Iterable[str] = (),
               settled: StopAtFlip | None = None) -> History:
        # ``until``, ``settled``: a wall-clock server runs the whole trace.
        self.start()
        names = list(trace.engine.toggles if toggles is None else toggles)
        if names:
            raise BadInput("toggles cannot be applied to a server kvfuzz does not manage (--base-url)",
                           field="toggles")
        book = None
        if trace.lifecycle:
            self._require_runtime_lora()
        self._require_resets(trace)
        salt = self._before_run()
        if trace.lifecycle:
            book = self._adapter_book(trace)
            self._bind_working_copies(book, trace)
        hist, errors = self._http_replay(trace, arm=arm, run_index=run_index, toggles=[], cache_salt=salt, book=book)
        self._check(hist, errors, f"run {run_index + 1}")
        return hist

    def _before_run(self) -> str | None:
        assert self.target is not None
        control.wait_idle(self.target)
        self._restore_adapters()
        if self.reference_isolation == "reset_prefix_cache":
            control.reset_prefix_cache(self.target)
            return None
        if self.reference_isolation == "cache_salt":
            return new_salt("run")
        return None

    def run_alone(self, send: SendEvent, *, max_tokens: int | None = None,
                  binding: Binding | None = None) -> RequestRecord:
        self.start()
        salt = self._before_run()
        target, temp = self._reference_target(send, binding)
        try:
            one = self._alone_trace(self.config, send, max_tokens, binding)
            hist, errors = self._http_replay(one, arm="reference", run_index=0, toggles=[], cache_salt=salt,
                                             target=target)
        finally:
            self._drop_reference_adapter(temp)
        self._check(hist, errors, f"the reference run of {send.request_id!r}")
        rec = hist.requests[send.request_id]
        if rec.error:
            raise InfraError(f"reference run for {send.request_id!r} failed: {rec.error}")
        return self._note_reference_binding(rec, binding)

    def score(self, send: SendEvent, tokens: Sequence[int], *, binding: Binding | None = None) -> list[TopLogprobs]:
        """Teacher forcing with the references' isolation (a prefix-cache reset, or a fresh salt)."""
        self.start()
        assert self.target is not None
        salt = self._before_run()
        prompt = expand(send.prompt)
        scored = [int(x) for x in tokens][: max(0, self.config.max_model_len - len(prompt) - 1)]
        if not scored:
            return []
        target, temp = self._reference_target(send, binding)
        try:
            return control.score(target, prompt, scored, adapter=send.adapter, cache_salt=salt,
                                 timeout_s=self.request_timeout_s)
        finally:
            self._drop_reference_adapter(temp)

    def noise_key(self) -> NoiseKey:
        """A server kvfuzz does not manage: its device is unknown, so its profile is its own
        (measured through the same URL)."""
        from .environment import noise_key

        self.start()
        return noise_key(self.config.model_copy(update={"model": self._model or self.config.model}),
                         device="url", model_hash=None, name=self.shown_url)

    def environment(self) -> Environment:
        from .environment import describe

        flags: dict[str, Any] = {
            "base_url": self.shown_url,
            "served_model": self._model,
            "served_models": self.models,
            "reference_isolation": self.reference_isolation,
            "note": "server not managed by kvfuzz: the trace's engine configuration describes, not configures, it",
        }
        env = describe(engine="url", config=self.config, device="unknown", model_hash=None,
                       flags={**self.config.model_dump(mode="json", exclude={"toggles"}), "server": flags})
        env.model = self._model
        return env
