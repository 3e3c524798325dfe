"""Replay a trace over HTTP against an OpenAI-compatible vLLM server, in real time (asyncio).

Each send goes to ``/v1/completions`` at its ``offset_ms`` from the trace start (the wire
format is http/wire.py). A cancel closes the request's connection at its offset, or — for a
cancel relative to the request's life (``At.after_tokens``) — once the stream has delivered
that many tokens. What was planned and what happened (send, first-token, cancel and finish
times, HTTP status, error body, tokens, logprobs) lands in a ``History`` exactly like the
in-process harness's.

Adapter lifecycle events (load / unload / reload) go to vLLM's runtime endpoints
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; a reload is a load with
``load_inplace``) at their offsets, one at a time per adapter name, in the trace's planned
order (``Trace.planned_order``) with the sends: a send on adapter N is not written before the
lifecycle events on N planned before it have been answered, and a load or reload of N waits
until the sends on N planned before it are written (an unload: until the server has answered
them, so it cannot take the name from under a request it has not resolved yet). A send is thus
admitted with the binding the plan gives it, up to one race the oracle already allows for: a
reload landing while a request on the same adapter runs (verdict ``unconstrained``). The
weights' paths, content hashes and the working copies that same-path reloads overwrite come
from the run's ``AdapterBook`` (harness/adapters.py), as in the in-process engine. Each event
is recorded with its actual offset taken when it starts (before a same-path reload overwrites
any file) and, when the server refuses, its HTTP status and body.

Timing: a send must cost as little as possible at its instant, so each request's bytes are
serialized (with h11) before the trace starts and its TCP connection is opened up to
``PRECONNECT_MS`` ahead; at the instant the client writes the whole request in one socket
write and records that moment as the actual send time. Waiting sleeps until ~2 ms before
the instant, then yields in a tight loop (event-loop timers are only millisecond-accurate).
Responses are parsed with h11 (chunked SSE streams or JSON bodies).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import ssl
import time
from collections.abc import Iterable
from typing import Any

import h11
import httpx

from kvfuzz.traces import CancelEvent, EventRecord, History, RequestRecord, SendEvent, Trace, expand
from kvfuzz.traces.errors import KvfuzzError
from kvfuzz.traces.trace import (
    ADAPTER_EVENT_TYPES,
    AdapterEvent,
    LoadAdapterEvent,
    ReloadAdapterEvent,
    ResetPrefixCacheEvent,
    UnloadAdapterEvent,
)

from ..adapters import AdapterBook, Bound
from ..priority import send_priority
from .control import scrape
from ..vllm_args import greedy_logprobs
from .wire import (
    RESET_PATH,
    HttpTarget,
    adapter_request,
    completion_payload,
    error_text,
    parse_choice,
    prompt_token_logprobs,
    reset_answer,
    reset_query,
)

# The last ~2 ms before a planned instant are spent yielding in a loop: the event loop's
# timers are only millisecond-accurate.
SPIN_S = 0.002
# A request's connection is opened this long before its send (those due early: before the
# clock starts), so no send pays for a TCP connect.
PRECONNECT_MS = 500.0
READ_SIZE = 65536


TRACE_SLACK_S = 5.0


def relative_floor_ms(at: Any, ms_per_step: float) -> float | None:
    """Earliest wall-clock offset of a relative cancel that also names a time, else None."""
    if at.offset_ms is not None:
        return float(at.offset_ms)
    if at.step is not None:
        return at.step * ms_per_step
    return None


class TransportFailure(Exception):
    """The connection failed (refused, reset, closed mid-response): the server may be gone."""


class _RelativeCancel(Exception):
    pass


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Req:
    """Per-request state during one replay."""

    def __init__(self, index: int, send: SendEvent, planned_ms: float, stream: bool):
        self.index = index
        self.send = send
        self.planned_ms = planned_ms
        self.stream = stream
        self.wire = b""
        self.conn: asyncio.Task[Conn] | None = None
        self.record = RequestRecord(request_id=send.request_id, adapter=send.adapter,
                                    prompt_len=send.prompt.length, max_tokens=send.max_tokens,
                                    planned_offset_ms=round(planned_ms, 3))
        # One record per completion of ``n`` (choice index k): the request's own, then ``ID#k``.
        self.completions = [self.record] + [self.record.model_copy(update={"request_id": cid}, deep=True)
                                            for cid in send.completion_ids[1:]]
        self.greedy = greedy_logprobs(send.sampling)
        self.task: asyncio.Task[None] | None = None
        self.done = False
        self.cancel_reason: str | None = None
        # Relative cancels on this request: (event index, after_tokens, floor offset ms or None).
        self.relative: list[tuple[int, int, float | None]] = []
        # Lifecycle events on this request's adapter and prefix-cache resets planned before it
        # (sent after they end).
        self.waits: list[_Life | _Reset] = []
        # Set once the request's bytes are written / the server answered (status line) or it ended.
        self.written = asyncio.Event()
        self.resolved = asyncio.Event()


def _synced(child: RequestRecord, own: RequestRecord) -> RequestRecord:
    """A completion of ``n`` with what the request's own record holds for all of them: when it
    was sent, the server's answer, the weights it ran with, an error that ended the request."""
    if child is own:
        return own
    child.sent_ms, child.http_status = own.sent_ms, own.http_status
    child.adapter_source, child.adapter_hash = own.adapter_source, own.adapter_hash
    if own.error and child.error is None:
        child.error, child.finish_reason = own.error, own.finish_reason
    if child.finished_ms is None and not child.cancelled:
        child.finished_ms = own.finished_ms
    return child


class _Life:
    """One adapter lifecycle event during one replay."""

    def __init__(self, index: int, ev: AdapterEvent, planned_ms: float):
        self.index = index
        self.ev = ev
        self.planned_ms = planned_ms
        # Sends on the same adapter planned before this event.
        self.after: list[_Req] = []
        self.done = asyncio.Event()


class _Reset:
    """One prefix-cache reset during one replay."""

    def __init__(self, index: int, ev: ResetPrefixCacheEvent, planned_ms: float):
        self.index = index
        self.ev = ev
        self.planned_ms = planned_ms
        # Sends planned before this reset (it is posted once they are written).
        self.after: list[_Req] = []
        self.done = asyncio.Event()


class Replayer:
    """One replay of one trace against one target."""

    def __init__(self, target: HttpTarget, trace: Trace, *, engine: str, arm: str, run_index: int,
                 toggles: list[str], cache_salt: str | None, timeout_s: float, lead_ms: float,
                 book: AdapterBook | None = None, touched: set[str] | None = None,
                 embeds_model: str | None = None):
        if trace.lifecycle and book is None:
            raise ValueError("a trace with adapter lifecycle events needs the run's AdapterBook")
        self.target = target
        self.trace = trace
        # The isolation salt (harness/url.py); a send's own cache_salt is joined to it.
        self.cache_salt = cache_salt
        self.book = book
        # Served adapter names this replay asked the server to change (the engine restores them).
        self.touched = touched if touched is not None else set()
        # The served model's local directory: its table builds the sends' prompt embeddings.
        self.embeds_model = embeds_model
        self.lifecycle: list[_Life] = []
        self.resets: list[_Reset] = []
        self.timeout_s = timeout_s
        self.lead_ms = lead_ms
        self.hist = History(trace_id=trace.trace_id(), engine=engine, arm=arm, run_index=run_index,  # type: ignore[arg-type]
                            toggles=toggles)
        self.t0 = time.perf_counter() + 3600.0  # set for real when the clock starts
        self.reqs: dict[str, _Req] = {}
        self.transport_errors: list[str] = []

    def now_ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    async def sleep_until_ms(self, offset_ms: float, *, spin: bool = True) -> None:
        deadline = self.t0 + offset_ms / 1000.0
        delay = deadline - time.perf_counter() - (SPIN_S if spin else 0.0)
        if delay > 0:
            await asyncio.sleep(delay)
        while spin and time.perf_counter() < deadline:
            await asyncio.sleep(0)

    # -- plan ----------------------------------------------------------------------------------
    def plan(self) -> list[tuple[int, CancelEvent, float]]:
        mps = self.trace.engine.ms_per_step
        timed_cancels: list[tuple[int, CancelEvent, float]] = []
        for i, ev in enumerate(self.trace.events):
            if isinstance(ev, SendEvent):
                self.reqs[ev.request_id] = _Req(i, ev, ev.at.offset_or(mps), ev.stream)
        for i, ev in enumerate(self.trace.events):
            if isinstance(ev, CancelEvent):
                r = self.reqs[ev.request_id]
                if ev.at.after_tokens is not None:
                    r.relative.append((i, ev.at.after_tokens, relative_floor_ms(ev.at, mps)))
                    # Counting tokens needs a stream; the engine sees the same request either way.
                    r.stream = True
                else:
                    timed_cancels.append((i, ev, ev.at.offset_or(mps)))
        for r in self.reqs.values():
            if r.send.sampling.prompt_logprobs is not None and not r.relative:
                # vLLM returns prompt logprobs in a whole response only.
                r.stream = False
        order = {i: k for k, i in enumerate(self.trace.planned_order())}
        for i in sorted(order, key=order.__getitem__):
            ev = self.trace.events[i]
            if isinstance(ev, ADAPTER_EVENT_TYPES):
                life = _Life(i, ev, ev.at.offset_or(mps))
                life.after = [r for r in self.reqs.values() if r.send.adapter == ev.name and order[r.index] < order[i]]
                for r in self.reqs.values():
                    if r.send.adapter == ev.name and order[r.index] > order[i]:
                        r.waits.append(life)
                self.lifecycle.append(life)
            elif isinstance(ev, ResetPrefixCacheEvent):
                reset = _Reset(i, ev, ev.at.offset_or(mps))
                reset.after = [r for r in self.reqs.values() if order[r.index] < order[i]]
                for r in self.reqs.values():
                    if order[r.index] > order[i]:
                        r.waits.append(reset)
                self.resets.append(reset)
        for r in self.reqs.values():
            body = completion_payload(r.send, self.target.model_for(r.send.adapter), stream=r.stream,
                                      cache_salt=self.cache_salt, embeds_model=self.embeds_model)
            r.wire = self.target.raw_request(
                "/v1/completions", json.dumps(body, separators=(",", ":")).encode(),
                {"X-Request-Id": f"kvfuzz-{r.send.request_id}-{secrets.token_hex(4)}"})
        return timed_cancels

    # -- connections ---------------------------------------------------------------------------
    async def connect(self) -> Conn:
        host, port, tls, _ = self.target.endpoint()
        ctx = ssl.create_default_context() if tls else None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=ctx, server_hostname=host if tls else None), timeout=10.0)
        except (OSError, asyncio.TimeoutError) as e:
            raise TransportFailure(f"cannot connect to {host}:{port}: {type(e).__name__}: {e}") from None
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def preconnect(self, r: _Req) -> Conn:
        await self.sleep_until_ms(r.planned_ms - PRECONNECT_MS, spin=False)
        return await self.connect()

    # -- one request ---------------------------------------------------------------------------
    async def run_request(self, r: _Req) -> None:
        ev = EventRecord(index=r.index, kind="send", request_id=r.send.request_id,
                         planned_offset_ms=round(r.planned_ms, 3))
        rec = r.record
        writer: asyncio.StreamWriter | None = None
        try:
            assert r.conn is not None
            reader, writer = await r.conn
            await self.sleep_until_ms(r.planned_ms)
            for life in r.waits:  # lifecycle events on this adapter and resets planned before this send
                await life.done.wait()
            if reader.at_eof():  # the peer dropped the idle connection: pay for a fresh one
                writer.transport.abort()
                reader, writer = await self.connect()
            self._note_binding(r)
            writer.write(r.wire)
            rec.sent_ms = round(self.now_ms(), 3)
            r.written.set()
            # Per-request deadline: a server that stops answering must not hold the run forever.
            await asyncio.wait_for(self._consume(r, reader), timeout=self.timeout_s)
        except asyncio.CancelledError:
            if r.cancel_reason is None:
                raise  # the whole replay is being torn down
            self._mark_cancelled(r)
        except _RelativeCancel:
            self._mark_cancelled(r)
        except asyncio.TimeoutError:  # before OSError: TimeoutError is one
            msg = f"hang: no complete response within {self.timeout_s:g} s"
            rec.error = msg
            rec.finish_reason = "error"
            self.transport_errors.append(f"{r.send.request_id}: {msg}")
        except (TransportFailure, OSError, h11.ProtocolError) as e:
            msg = f"connection failed: {type(e).__name__}: {e}".strip().rstrip(":")
            rec.error = msg
            rec.finish_reason = "error"
            self.transport_errors.append(f"{r.send.request_id}: {msg}")
        except ValueError as e:  # malformed body / token format
            rec.error = f"bad response: {e}"
            rec.finish_reason = "error"
        finally:
            if writer is not None:
                # abort(), not close(): a cancel must reach the server as a disconnect now.
                writer.transport.abort()
            ev.actual_offset_ms = rec.sent_ms
            self.hist.events.append(ev)
            r.done = True
            r.written.set()
            r.resolved.set()
            if rec.finished_ms is None and not rec.cancelled:
                rec.finished_ms = round(self.now_ms(), 3)

    async def _consume(self, r: _Req, reader: asyncio.StreamReader) -> None:
        """Read the response with h11: status, then an SSE stream or a JSON body."""
        rec = r.record
        conn = h11.Connection(h11.CLIENT)
        # h11 parses a response only after it has seen its request go out.
        conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
        conn.send(h11.EndOfMessage())
        body = bytearray()
        sse = bytearray()
        status = 0
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(READ_SIZE))  # b"" = EOF
                continue
            if isinstance(event, h11.Response):
                status = rec.http_status = event.status_code
                r.resolved.set()  # the server has resolved the request's model (adapter)
                if status == 200 and r.stream:
                    self._check_relative(r)  # after_tokens=0: the server took the request
            elif isinstance(event, h11.Data):
                if status != 200 or not r.stream:
                    body += event.data
                    continue
                sse += event.data
                while (nl := sse.find(b"\n")) >= 0:
                    line = bytes(sse[:nl]).strip()
                    del sse[: nl + 1]
                    if self._sse_line(r, line):
                        return
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise TransportFailure("connection closed before the response ended")
        if status != 200:
            rec.error = error_text(status, bytes(body))
            rec.finish_reason = "error"
        elif not r.stream:
            self._consume_json(r, json.loads(bytes(body)))
        elif rec.finish_reason is None and rec.error is None:
            raise TransportFailure("stream ended without a finish_reason")

    def _sse_line(self, r: _Req, line: bytes) -> bool:
        """Handle one SSE line; True when the stream is over."""
        rec = r.record
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            rec.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            rec.finish_reason = "error"
            return True
        for choice in chunk.get("choices") or []:
            tokens, tops, finish = parse_choice(choice)
            one = self._append(r, tokens, tops, choice.get("index", 0))
            if finish:
                one.finish_reason = finish
                one.finished_ms = round(self.now_ms(), 3)
        if rec.finish_reason is None:
            self._check_relative(r)
        return False

    def _consume_json(self, r: _Req, body: dict[str, Any]) -> None:
        rec = r.record
        if "error" in body:
            rec.error = error_text(200, json.dumps(body))
            rec.finish_reason = "error"
            return
        choices = body.get("choices") or []
        if not choices:
            raise ValueError("completion without choices")
        for choice in choices:
            tokens, tops, finish = parse_choice(choice)
            one = self._append(r, tokens, tops, choice.get("index", 0))
            one.finish_reason = finish or "stop"
            one.finished_ms = round(self.now_ms(), 3)
            if r.send.sampling.prompt_logprobs is not None and choice.get("prompt_logprobs"):
                one.prompt_logprobs = prompt_token_logprobs(choice["prompt_logprobs"], expand(r.send.prompt))
        usage = body.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if isinstance(details, dict) and details.get("cached_tokens") is not None:
            rec.num_cached_tokens = int(details["cached_tokens"])

    def _mark_cancelled(self, r: _Req) -> None:
        for rec in r.completions:
            if rec is r.record or rec.finish_reason is None:
                rec.cancelled = True
                rec.finish_reason = "abort"
                rec.cancel_ms = round(self.now_ms(), 3)
                rec.finished_ms = rec.cancel_ms

    def _append(self, r: _Req, tokens: list[int], tops: list[list[tuple[int, float]]],
                index: int = 0) -> RequestRecord:
        if not 0 <= index < len(r.completions):
            raise ValueError(f"choice index {index} for a request of n = {len(r.completions)}")
        rec = r.completions[index]
        # A non-streamed response shows no first-token time, only its end.
        if tokens and rec.first_token_ms is None and r.stream:
            rec.first_token_ms = round(self.now_ms(), 3)
        rec.token_ids.extend(tokens)
        if r.greedy:  # a child of n has no margin of its own (harness/vllm_args.py)
            rec.logprobs.extend(tops)
        return rec

    def _check_relative(self, r: _Req) -> None:
        n = len(r.record.token_ids)
        for k, (i, after, floor) in enumerate(r.relative):
            if n >= after:
                if floor is not None and self.now_ms() < floor:
                    continue  # the time part of the condition is left to relative_timer
                self.hist.events.append(EventRecord(index=i, kind="cancel", request_id=r.send.request_id,
                                                    planned_offset_ms=floor, actual_offset_ms=round(self.now_ms(), 3)))
                r.relative.pop(k)
                r.cancel_reason = "relative"
                raise _RelativeCancel()

    def _note_binding(self, r: _Req) -> None:
        """The binding ``r``'s adapter has as it is sent: what its reference runs with."""
        if self.book is None or r.send.adapter is None:
            return
        bound = self.book.get(r.send.adapter)
        if bound is not None:
            r.record.adapter_source, r.record.adapter_hash = bound.source, bound.content_hash

    # -- adapter lifecycle -----------------------------------------------------------------------
    async def run_lifecycle(self, chain: list[_Life]) -> None:
        """One adapter name's lifecycle events, one at a time in planned order, each at its
        offset once the sends it must follow are out (see the module docstring). Names have
        chains of their own: an unload waiting for a long non-streamed answer (its status line
        comes only with the whole body) holds back its own name's later events, no other's."""
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False) as client:
                for life in chain:
                    await self.sleep_until_ms(life.planned_ms)
                    unload = isinstance(life.ev, UnloadAdapterEvent)
                    for r in life.after:
                        await (r.resolved if unload else r.written).wait()
                    await self.apply(client, life)
                    life.done.set()
        finally:
            for life in chain:  # nothing may wait forever on an event that never ran
                life.done.set()

    async def apply(self, client: httpx.AsyncClient, life: _Life) -> None:
        ev = life.ev
        assert self.book is not None
        rec = EventRecord(index=life.index, kind=ev.kind, adapter=ev.name,
                          planned_offset_ms=round(life.planned_ms, 3), actual_offset_ms=round(self.now_ms(), 3))
        self.hist.events.append(rec)
        bound: Bound | None = None
        try:
            if isinstance(ev, LoadAdapterEvent):
                bound = self.book.load(ev)
            elif isinstance(ev, ReloadAdapterEvent):
                bound = self.book.reload(ev)  # same_path: the working copy is overwritten here
            else:
                self.book.unload(ev)
        except (OSError, KvfuzzError) as e:
            rec.error = f"adapter source {getattr(ev, 'source', ev.name)!r}: {e}"
            return
        rec.adapter_hash = bound.content_hash if bound is not None else None
        name = self.target.model_for(ev.name)
        endpoint, body = adapter_request(ev.kind, name, bound.path if bound is not None else None)
        self.touched.add(name)
        try:
            resp = await client.post(self.target.url(endpoint), json=body, headers=self.target.headers())
        except httpx.HTTPError as e:
            rec.error = f"connection failed: {type(e).__name__}: {e}".strip().rstrip(":")
            self.transport_errors.append(f"{ev.kind} {ev.name}: {rec.error}")
            return
        if resp.status_code != 200:
            rec.error = error_text(resp.status_code, resp.content)

    # -- prefix-cache resets -------------------------------------------------------------------
    async def run_reset(self, reset: _Reset) -> None:
        """POST /reset_prefix_cache at the reset's offset, once the sends planned before it are
        written (the sends planned after it wait for its answer), recorded with what the server
        said: done, declined (blocks still held), or unreported (an empty 200 of releases before
        0.32); an HTTP error is recorded, not raised."""
        try:
            await self.sleep_until_ms(reset.planned_ms)
            for r in reset.after:
                await r.written.wait()
            rec = EventRecord(index=reset.index, kind=reset.ev.kind, planned_offset_ms=round(reset.planned_ms, 3),
                              actual_offset_ms=round(self.now_ms(), 3))
            self.hist.events.append(rec)
            query = reset_query(reset_running_requests=reset.ev.reset_running_requests)
            try:
                async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False) as client:
                    resp = await client.post(self.target.url(RESET_PATH), params=query, headers=self.target.headers())
            except httpx.HTTPError as e:
                rec.error = f"connection failed: {type(e).__name__}: {e}".strip().rstrip(":")
                rec.effective = False
                self.transport_errors.append(f"{reset.ev.kind}: {rec.error}")
                return
            rec.reset = reset_answer(resp.status_code, resp.content)
            if rec.reset is None:
                rec.error = error_text(resp.status_code, resp.content)
            rec.effective = rec.reset in ("done", "unreported")
        finally:
            reset.done.set()  # nothing may wait forever on a reset that never ran

    # -- cancels -------------------------------------------------------------------------------
    async def run_cancel(self, i: int, ev: CancelEvent, planned_ms: float) -> None:
        await self.sleep_until_ms(planned_ms)
        r = self.reqs[ev.request_id]
        # A cancel before its request was sent, or after it finished, does nothing (as in the
        # in-process harness).
        effective = r.record.sent_ms is not None and not r.done and r.task is not None
        self.hist.events.append(EventRecord(index=i, kind="cancel", request_id=ev.request_id,
                                            planned_offset_ms=round(planned_ms, 3),
                                            actual_offset_ms=round(self.now_ms(), 3), effective=effective))
        if effective and r.task is not None:
            r.cancel_reason = "timed"
            r.task.cancel()

    async def relative_timer(self, r: _Req) -> None:
        """Relative cancels whose token count was reached before their time floor."""
        while r.relative and not r.done:
            pending = [(i, a, f) for i, a, f in r.relative if f is not None]
            if not pending:
                return
            i, after, floor = min(pending, key=lambda x: x[2] or 0.0)
            await self.sleep_until_ms(floor or 0.0)
            if r.done:
                return
            if len(r.record.token_ids) >= after and r.task is not None:
                r.relative.remove((i, after, floor))
                self.hist.events.append(EventRecord(index=i, kind="cancel", request_id=r.send.request_id,
                                                    planned_offset_ms=floor, actual_offset_ms=round(self.now_ms(), 3)))
                r.cancel_reason = "relative"
                r.task.cancel()
                return
            await asyncio.sleep(0.001)

    # -- the run ------------------------------------------------------------------------------
    async def run(self) -> History:
        timed_cancels = self.plan()
        self.hist.metrics_before = await scrape(self.target)
        # Connections due within PRECONNECT_MS of the start are opened before the clock starts.
        self.t0 = time.perf_counter() + self.lead_ms / 1000.0
        early = {rid for rid, r in self.reqs.items() if r.planned_ms < PRECONNECT_MS}
        early_conns: list[asyncio.Task[Conn]] = []
        for rid, r in self.reqs.items():
            r.conn = asyncio.create_task(self.connect() if rid in early else self.preconnect(r))
            if rid in early:
                early_conns.append(r.conn)
        if early_conns:
            await asyncio.wait(early_conns)
        start = time.perf_counter()
        self.t0 = start + self.lead_ms / 1000.0
        tasks: list[asyncio.Task[None]] = []
        for r in self.reqs.values():
            r.task = asyncio.create_task(self.run_request(r))
            tasks.append(r.task)
            if any(f is not None for _, _, f in r.relative):
                tasks.append(asyncio.create_task(self.relative_timer(r)))
        tasks += [asyncio.create_task(self.run_cancel(i, ev, ms)) for i, ev, ms in timed_cancels]
        chains: dict[str, list[_Life]] = {}
        for life in self.lifecycle:
            chains.setdefault(life.ev.name, []).append(life)
        tasks += [asyncio.create_task(self.run_lifecycle(chain)) for chain in chains.values()]
        tasks += [asyncio.create_task(self.run_reset(reset)) for reset in self.resets]
        last_planned = max([r.planned_ms for r in self.reqs.values()] + [ms for _, _, ms in timed_cancels]
                           + [life.planned_ms for life in self.lifecycle] + [x.planned_ms for x in self.resets]
                           + [0.0])
        # Per-trace deadline: the last send's plan plus the per-request deadline, plus slack so
        # that the per-request deadline (which names the request) fires first.
        budget = self.timeout_s + last_planned / 1000.0 + self.lead_ms / 1000.0 + TRACE_SLACK_S
        done, pending = await asyncio.wait(tasks, timeout=budget)
        if pending:
            self.hist.crashed, self.hist.crash_kind = True, "hang"
            unfinished = sorted(r.send.request_id for r in self.reqs.values() if not r.done)
            self.hist.crash_detail = (f"hang: {len(unfinished)} request(s) unfinished after {budget:.0f} s "
                                      f"({', '.join(unfinished[:5])})")
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        for r in self.reqs.values():
            if r.conn is not None and not r.conn.done():
                r.conn.cancel()
            # A relative cancel whose request ended first did nothing.
            for i, _after, floor in r.relative:
                self.hist.events.append(EventRecord(index=i, kind="cancel", request_id=r.send.request_id,
                                                    planned_offset_ms=floor, effective=False))
        self.hist.wall_seconds = round(time.perf_counter() - start, 4)
        if not self.transport_errors:
            self.hist.metrics_after = await scrape(self.target)
        self.hist.events.sort(key=lambda e: (e.actual_offset_ms if e.actual_offset_ms is not None else float("inf"),
                                             e.index))
        self.hist.requests = {c.request_id: _synced(c, r.record) for r in self.reqs.values() for c in r.completions}
        return self.hist



def replay_trace(target: HttpTarget, trace: Trace, *, engine: str = "server", arm: str = "default",
                 run_index: int = 0, toggles: Iterable[str] = (), cache_salt: str | None = None,
                 timeout_s: float = 300.0, lead_ms: float = 50.0, book: AdapterBook | None = None,
                 touched: set[str] | None = None, embeds_model: str | None = None) -> tuple[History, list[str]]:
    """Replay ``trace`` once; returns the history and the transport errors seen (non-empty
    when connections failed, e.g. because the server died). ``cache_salt``: the isolation salt,
    joined with each send's own (``wire.combine_salts``). ``book``: the run's adapter bindings
    (needed for lifecycle events; with it every adapter request records its binding);
    ``touched`` collects the served adapter names the run changed, for the engine to restore.
    ``embeds_model``: the served model's local directory, whose embedding table builds the
    sends' prompt embeddings (``wire.prompt_fields``; without it such a send is refused)."""
    rep = Replayer(target, trace, engine=engine, arm=arm, run_index=run_index, toggles=list(toggles),
                   cache_salt=cache_salt, timeout_s=timeout_s, lead_ms=lead_ms, book=book, touched=touched,
                   embeds_model=embeds_model)
    with send_priority() as prio:
        hist = asyncio.run(rep.run())
    hist.client_priority = prio
    return hist, rep.transport_errors


# -- small synchronous calls used by the engines ------------------------------------------------
