"""Adapter bindings during one run: which weights on disk each adapter name serves.

A trace's adapter lifecycle events (load / unload / reload) rebind names while requests run.
The book turns the plan into what an engine is given — a directory, a content hash, an adapter
id — the same way for the in-process engine (vLLM's ``add_lora``/``remove_lora``) and for a
server (``/v1/load_lora_adapter``). Built once; both harnesses use it.

``same_path`` reloads overwrite the files at the name's current directory. The directories of
the embedded adapters live in the kvfuzz cache and must never be overwritten, so a name that a
trace reloads in place is served from working copies that the book owns: each binding of such
a name (its initial one, a load, a new-path reload) gets a directory of its own, and only a
``same_path`` reload writes into an existing one — the binding's own, as a deployment updating
an adapter directory does. A load after an unload therefore never rewrites files that a request
still running on the old binding may re-read (vLLM reloads an evicted adapter from its path).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfuzz.traces import EngineConfig, SendEvent, Trace
from kvfuzz.traces.trace import Binding, LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

from .embedded import adapter_hash, build, resolve_adapter


def resolve_source(source: str) -> Path:
    """An adapter source's directory on this machine (embedded adapters and their variants are
    built on first use). A server must be able to read it: a URL server on another machine
    needs a shared path."""
    return resolve_adapter(source, build() if source.startswith("embedded:") else None)


def solo_engine(config: EngineConfig, send: SendEvent, binding: Binding | None) -> EngineConfig:
    """The engine section of ``send``'s reference run: no toggles, and its adapter name bound to
    ``binding``'s weights (a name a lifecycle event loaded is not among the configuration's)."""
    engine = config.model_copy(update={"toggles": []})
    if binding is not None and send.adapter is not None:
        lora = engine.lora.model_copy(update={"adapters": {**engine.lora.adapters, send.adapter: binding.source}})
        engine = engine.model_copy(update={"lora": lora})
    return engine


@dataclass(frozen=True)
class Bound:
    """An adapter name bound to weights: where they are, their content hash, the adapter id
    the engine knows them by, and whether the binding was made by an in-place reload."""

    name: str
    source: str
    path: str
    content_hash: str
    lora_id: int
    inplace: bool = False


class AdapterBook:
    """The bindings of one run, from the trace's initial adapters through its lifecycle events.

    ``resolve`` maps a source (``embedded:a@v2``, a directory) to its directory; ``workdir`` is
    where names reloaded in place get their working copies. Initial adapters get ids 1..n in
    name order (as before lifecycle events existed), later loads the next ids; a reload keeps
    the id, as vLLM's ``load_inplace`` does."""

    def __init__(self, trace: Trace, resolve: Callable[[str], Path], workdir: Path | None) -> None:
        self._resolve = resolve
        self._workdir = workdir
        self._hashes: dict[str, str] = {}
        self.in_place_names = {e.name for e in trace.lifecycle if isinstance(e, ReloadAdapterEvent) and e.same_path}
        if self.in_place_names and workdir is None:
            raise ValueError("a trace with same-path reloads needs a working directory")
        self.bound: dict[str, Bound] = {}
        self._next_id = 1
        self._copies = 0
        for name, source in sorted(trace.engine.lora.adapters.items()):
            self._bind(name, source, lora_id=self._take_id())

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _bind(self, name: str, source: str, *, lora_id: int, inplace: bool = False,
              path: Path | None = None) -> Bound:
        """Bind ``name`` to ``source``'s weights. For a name reloaded in place somewhere in the
        trace: into ``path`` (a same-path reload: the binding's own directory, overwritten) or
        else a new working directory."""
        src = self._resolve(source)
        if name in self.in_place_names:
            assert self._workdir is not None
            if path is None:
                self._copies += 1
                path = self._workdir / name / str(self._copies)
            _overwrite_dir(src, path)
            digest = adapter_hash(path)  # what is at the path now
        else:
            path = src
            key = str(src)
            if key not in self._hashes:
                self._hashes[key] = adapter_hash(src)
            digest = self._hashes[key]
        b = Bound(name=name, source=source, path=str(path), content_hash=digest, lora_id=lora_id, inplace=inplace)
        self.bound[name] = b
        return b

    def load(self, ev: LoadAdapterEvent) -> Bound:
        return self._bind(ev.name, ev.source, lora_id=self._take_id())

    def unload(self, ev: UnloadAdapterEvent) -> Bound:
        return self.bound.pop(ev.name)

    def reload(self, ev: ReloadAdapterEvent) -> Bound:
        old = self.bound[ev.name]
        if ev.same_path:  # the name is in in_place_names: its binding is a working copy
            return self._bind(ev.name, ev.source, lora_id=old.lora_id, inplace=True, path=Path(old.path))
        return self._bind(ev.name, ev.source, lora_id=old.lora_id, inplace=True)

    def get(self, name: str) -> Bound | None:
        return self.bound.get(name)


def _overwrite_dir(src: Path, dst: Path) -> None:
    """Replace the files in ``dst`` by ``src``'s, as a deployment updating an adapter directory
    in place does (same directory, new bytes)."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in dst.iterdir():
        if p.is_file():
            p.unlink()
    for p in src.iterdir():
        if p.is_file():
            shutil.copyfile(p, dst / p.name)



class AdapterWorkdir:
    """An engine's directory for the working copies of names reloaded in place: made on first
    need, the same path for every run (the prefix-cache key of vLLM 0.31+ includes the path),
    removed by ``drop`` when the engine closes."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def book(self, trace: Trace) -> AdapterBook:
        """This run's bindings. Every source is resolved now, so an embedded variant is built
        before the run rather than at its event's instant."""
        if self.path is None and any(isinstance(e, ReloadAdapterEvent) and e.same_path for e in trace.lifecycle):
            self.path = Path(tempfile.mkdtemp(prefix="kvfuzz-adapters-"))
        for ev in trace.lifecycle:
            if isinstance(ev, (LoadAdapterEvent, ReloadAdapterEvent)):
                resolve_source(ev.source)
        return AdapterBook(trace, resolve_source, self.path)

    def drop(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
