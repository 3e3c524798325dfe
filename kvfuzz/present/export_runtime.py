"""The code of the scripts ``kvfuzz export`` writes (kvfuzz/present/export.py), as text.

These strings are copied into each script after its ``FINDING`` literal and the embedded
model's build recipe. They are standalone: vLLM, the standard library, and torch / numpy /
safetensors (which ship with vLLM); never kvfuzz. They mirror, without importing it, what
kvfuzz's harness does: ``harness/inprocess.py`` (``replay``: events before engine steps, relative
cancels, outputs per completion), ``harness/adapters.py`` (working copies), ``harness/http/``
(wall-clock sends and cancels, the runtime adapter endpoints) and the oracle's comparison
(``oracle/diff.py`` ``compare``; ``oracle/check.py``'s truncation and ``unconstrained`` cases).
A speculative finding's in-process script also calls ``tolerate_kernel_scan`` before each engine
start, as ``harness/inprocess.py`` does, from a verbatim copy of ``harness/compat.py``'s
(``KERNEL_SCAN``); other scripts do not carry it.
tests/test_export.py compiles, runs and inspects them.
"""

from __future__ import annotations

PRELUDE = r'''
from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from pathlib import Path
from types import SimpleNamespace
'''


COMMON = r'''
# -- shared by both forms -------------------------------------------------------------------------------


def say(msg: str = "") -> None:
    print(msg, flush=True)


def fail(msg: str) -> None:
    """The script could not run (exit 3): not a verdict."""
    say(f"repro: error: {msg}")
    raise SystemExit(3)


class Materials:
    """The model and adapter directories on this machine; the embedded ones are built here
    from the recipe above and must match kvfuzz's content hashes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.work = root / "work"  # working copies of adapters the schedule reloads in place
        self.dirs: dict[str, Path] = {}
        info = FINDING["model"]
        if info["embedded"] is not None:
            self.model = str(self._embedded(info["embedded"], info["hash"]) / "model")
        else:
            self.model = info["path"]
        for source, a in FINDING["adapter_sources"].items():
            if a["embedded"] is None:
                self.dirs[source] = Path(source)
                continue
            if a["version"] == 1:
                d = self._embedded(MODEL_NAME, None) / "adapters" / a["embedded"]
            else:
                d = self.root / "variants" / f"{a['embedded']}@v{a['version']}"
                if not (d / "adapter_model.safetensors").exists():
                    d.mkdir(parents=True, exist_ok=True)
                    seed = 1000 + ADAPTERS.index(a["embedded"]) + VARIANT_SEED_STRIDE * (a["version"] - 1)
                    _write_safetensors(d / "adapter_model.safetensors", _adapter_tensors(seed=seed))
                    _write_json(d / "adapter_config.json", _adapter_config())
            digest = content_hash(d)
            if digest != a["hash"]:
                fail(f"adapter {source} built here has content hash {digest}, kvfuzz's has {a['hash']}")
            self.dirs[source] = d

    def _embedded(self, name: str, expected: str | None) -> Path:
        root = self.root / name
        if (root / MANIFEST).exists():
            digest = content_hash(root)
        else:
            shutil.rmtree(root, ignore_errors=True)
            say(f"repro: building the embedded model {name} in {root}")
            digest = (_build_into if name == MODEL_NAME else _build_hybrid_into)(root)
        if expected is not None and digest != expected:
            fail(f"the embedded model {name} built here has content hash {digest}, kvfuzz's build has {expected}")
        return root

    def copy(self, rel: str, source: str) -> None:
        """Overwrite the working copy ``rel`` with ``source``'s files (an adapter directory
        updated in place, as a deployment does)."""
        dst = self.work / rel
        dst.mkdir(parents=True, exist_ok=True)
        for p in dst.iterdir():
            if p.is_file():
                p.unlink()
        for p in self.dirs[source].iterdir():
            if p.is_file():
                shutil.copyfile(p, dst / p.name)

    def path(self, spec: list) -> str:
        kind, value = spec
        return str(self.dirs[value] if kind == "source" else self.work / value)


_TABLES: dict = {}


def embedding_table(model_path: str):
    """The model's input embedding table (float32), from its safetensors files."""
    if model_path not in _TABLES:
        from safetensors import safe_open

        for f in sorted(Path(model_path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                if EMBED_TABLE in st.keys():
                    _TABLES[model_path] = st.get_tensor(EMBED_TABLE).float()
                    break
        else:
            fail(f"prompt embeddings need {EMBED_TABLE} from the model's safetensors files in {model_path}")
    return _TABLES[model_path]


def embeds_tensor(model: str, send: dict):
    return prompt_embeddings(model, list(FINDING["prompts"][send["prompt"]]), SimpleNamespace(**send["embeds"]))


def id_mask(length: int, ranges: list) -> list:
    mask = [False] * length
    for a, b in ranges:
        mask[a:b] = [True] * (b - a)
    return mask


class Outcome:
    """One completion's tokens and how it ended (steps in-process, milliseconds over HTTP)."""

    def __init__(self, cid: str, send: dict) -> None:
        self.id = cid
        self.send = send
        self.tokens: list = []
        self.logprobs: list = []  # per position: the chosen token's (id, logprob), then the best other's
        self.finish_reason = None
        self.cancelled = False
        self.error = None
        self.sent = None
        self.end = None


def sends() -> list:
    return [e["send"] for e in FINDING["schedule"] if e["op"] == "send"]


def send_of(cid: str) -> str:
    return next(s["id"] for s in sends() if cid in s["completions"])


def select_victims(only: list | None) -> list:
    victims = list(FINDING["victims"])
    if only:
        known = [c for s in sends() for c in s["completions"]]
        for r in only:
            if r not in known:
                say(f"repro: error: no request {r!r} (requests: {', '.join(known)})")
                raise SystemExit(2)
        victims = list(dict.fromkeys(only))
    return victims


@contextlib.contextmanager
def workdir(path: str | None):
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path).resolve()
        return
    root = Path(tempfile.mkdtemp(prefix="vllm-repro-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def unconstrained(o: Outcome, applied: list) -> bool:
    """The request's own adapter was reloaded in place (vLLM's load_inplace: new weights under
    its running adapter id) after it was admitted and before it ended: any output is legal."""
    adapter = o.send["adapter"]
    if adapter is None:
        return False
    admitted = False
    for op, name, when in applied:
        if op == "send" and name == o.send["id"]:
            admitted = True
        elif admitted and op == "reload" and name == adapter and (o.end is None or when <= o.end):
            return True
    return False


def margin(o: Outcome, i: int):
    if i < len(o.logprobs) and len(o.logprobs[i]) >= 2:
        return o.logprobs[i][0][1] - o.logprobs[i][1][1]
    return None


def judge(o: Outcome, ref: Outcome, applied: list, crash: str | None) -> tuple:
    """(differs, words): the run against its reference over the request's max_tokens."""
    if crash is not None and o.end is None:
        return True, f"ENGINE CRASH: {crash}"
    if o.error is not None:
        return True, f"FAILED: {o.error}"
    n = o.send["max_tokens"]
    a, b = ref.tokens[:n], o.tokens[:n]
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    why = None
    if i is not None:
        m = margin(ref, i)
        why = f"DIFFERS at token {i}: expected {a[i]}, got {b[i]}" + (
            f" (reference margin {m:.3g} nats over its runner-up)" if m is not None else "")
    elif len(b) < len(a):
        if o.cancelled:
            return False, f"same as far as it goes (cancelled after {len(b)} tokens)"
        if o.finish_reason == "stop":
            why = f"DIFFERS: stopped after {len(b)} tokens where the reference went on"
        else:
            return False, f"same as far as it goes (ended after {len(b)} tokens: {o.finish_reason})"
    elif len(b) > len(a) and ref.finish_reason == "stop":
        why = f"DIFFERS: went on after token {len(a)}, where the reference stopped"
    if why is None:
        return False, "same"
    if unconstrained(o, applied):
        return False, (why.split(":")[0].lower() + ", but its adapter was reloaded in place while it ran: any "
                       "output is legal (vLLM's load_inplace swaps weights under a running request)")
    return True, why


def report(victims: list, outcomes: dict, references: dict, applied: list, crash: str | None) -> int:
    say("")
    say("=" * 100)
    differ = []
    for cid in victims:
        o = outcomes.get(cid)
        s = next(x for x in sends() if cid in x["completions"])
        say(f"request {cid} ({'adapter ' + s['adapter'] if s['adapter'] else 'base model'}, "
            f"{len(FINDING['prompts'][s['prompt']])}-token prompt, max_tokens {s['max_tokens']})")
        if o is None:
            say("  never sent (the run ended first)")
            continue
        ref = references.get(s["id"])
        if ref is not None:
            say(f"  expected (alone): {ref.tokens[: s['max_tokens']]}")
        say(f"  actual (schedule): {o.tokens}" + (" (cancelled)" if o.cancelled else ""))
        recorded = FINDING["recorded"].get(cid) or {}
        if recorded.get("run") is not None and recorded["run"] != o.tokens:
            say(f"  kvfuzz recorded this run as {recorded['run']}")
        if ref is not None and recorded.get("reference") is not None \
                and recorded["reference"][: s["max_tokens"]] != ref.tokens[: s["max_tokens"]]:
            say(f"  kvfuzz recorded the reference as {recorded['reference'][: s['max_tokens']]}")
        if ref is None and (crash is None or o.end is not None):
            say("  no reference")
            continue
        bad, words = judge(o, ref if ref is not None else Outcome(cid, s), applied, crash)
        say(f"  -> {words}")
        if bad:
            differ.append(cid)
    say("=" * 100)
    other = another_failure(differ, outcomes, crash)
    if other is not None:
        say(f"INCONCLUSIVE: {other}")
        return 4
    if differ:
        say(f"REPRODUCED: {len(differ)} of {len(victims)} judged request(s) differ from their reference "
            f"({', '.join(differ)})")
        return 1
    say(f"NOT REPRODUCED: every judged request ({', '.join(victims)}) matches its reference")
    return 0


def another_failure(differ: list, outcomes: dict, crash: str | None):
    """Why what went wrong is not the failure kvfuzz recorded (None: it is, or nothing did).
    A finding of changed outputs is not reproduced by a crash that ended the run before a judged
    request could differ, nor a crash finding by changed outputs or by another exception: that is
    another bug, which hides whether this one is still there."""
    failure = FINDING["failure"]
    if failure is None or not (differ or crash):
        return None
    if failure["kind"] == "output":
        if crash is None or any(cid in outcomes and outcomes[cid].end is not None for cid in differ):
            return None
        return (f"the engine crashed ({crash}) before any judged request could differ; kvfuzz recorded "
                "changed outputs, not a crash: another bug ended the run")
    if crash is None:
        return (f"{len(differ)} judged request(s) differ from their reference ({', '.join(differ)}), but kvfuzz "
                "recorded a crash, which did not happen: another failure")
    now = crash_state(crash) if " raised " in crash else None
    if failure["state"] is not None and now is not None and now != failure["state"]:
        return f"the engine crashed with {now!r}; kvfuzz recorded {failure['state']!r}: another bug"
    return None
'''


# Speculative findings' in-process scripts only: why they carry harness/compat.py's
# ``tolerate_kernel_scan`` (copied below this comment), and its call, inserted in ``new_engine``
# before ENGINE_START. Without llvmlite loaded the call does nothing.
KERNEL_SCAN = r'''
# -- a workaround, not part of the finding (a copy of kvfuzz's harness/compat.py) --------------------
# Each reference starts a fresh engine in this process after the schedule's engine, which loaded
# numba and llvmlite for ngram speculative decoding. From vLLM 0.31.0 on, the CPU build's engine
# start scans every loaded module for Triton kernels and raises AttributeError on llvmlite's
# library wrapper, so the reference engine would not start. new_engine calls this first.
'''
KERNEL_SCAN_CALL = "    tolerate_kernel_scan()  # a reference engine after the speculative one: see above\n"
ENGINE_START = "    try:\n        return LLMEngine.from_engine_args(EngineArgs(**args))\n"


INPROCESS = r'''
# -- the in-process form: vLLM's LLMEngine, one step at a time ---------------------------------------


def new_engine(kwargs: dict, model: str):
    import dataclasses

    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = {"model": model, **kwargs}
    if "logprobs_mode" in {f.name for f in dataclasses.fields(EngineArgs)}:
        # The logprobs after each request's own processing (its margins); tokens do not depend on it.
        args.setdefault("logprobs_mode", "processed_logprobs")
    if isinstance(args.get("kv_transfer_config"), dict):
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    try:
        return LLMEngine.from_engine_args(EngineArgs(**args))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        fail(f"the vLLM engine failed to start: {type(e).__name__}: {e}".splitlines()[0])


def close_engine(engine) -> None:
    try:
        engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - shutting down a broken engine
        pass
    gc.collect()


def lora_request(materials: Materials, lora):
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    name, lora_id, spec, inplace = lora
    return LoRARequest(name, lora_id, materials.path(spec), load_inplace=inplace)


def sampling_params(send: dict):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(logprobs=2, output_kind=RequestOutputKind.DELTA, **send["params"])


def vllm_prompt(materials: Materials, send: dict) -> dict:
    tokens = list(FINDING["prompts"][send["prompt"]])
    if send["embeds"] is None:
        prompt = {"prompt_token_ids": tokens}
    else:
        prompt = {"prompt_embeds": embeds_tensor(materials.model, send)}
        if send["embeds"]["as_ids"]:
            prompt.update(prompt_token_ids=tokens, prompt_is_token_ids=id_mask(len(tokens), send["embeds"]["as_ids"]))
    if send["cache_salt"] is not None:
        prompt["cache_salt"] = send["cache_salt"]
    return prompt


def collect(outputs, children: dict, out: dict, step: int, live: set) -> None:
    """One step's outputs into the completions' records (a request of n has n completions)."""
    for ro in outputs:
        rid = ro.request_id
        if rid not in children:
            continue
        for comp in ro.outputs:
            rec = out[children[rid][comp.index]]
            if rec.cancelled or rec.end is not None:
                continue
            rec.tokens.extend(comp.token_ids)
            if rec.send["n"] == 1:
                for tok, pos in zip(comp.token_ids, comp.logprobs or []):
                    others = sorted(((t, lp.logprob) for t, lp in pos.items() if t != tok), key=lambda x: -x[1])
                    top = ([(tok, pos[tok].logprob)] if tok in pos else []) + others[: 2 - (tok in pos)]
                    rec.logprobs.append([(int(t), float(lp)) for t, lp in top])
            if comp.finish_reason is not None:
                rec.finish_reason, rec.end = comp.finish_reason, step
        if ro.finished:
            for c in children[rid]:
                rec = out[c]
                if not rec.cancelled and rec.end is None:
                    rec.finish_reason, rec.end = "stop", step
            live.discard(rid)


def watch_scheduler(engine, scheduled: set, internal: dict) -> bool:
    """Record which requests the scheduler has scheduled (a cancel relative to a request's life
    waits until it has been scheduled once). vLLM internals: optional."""
    try:
        scheduler = engine.engine_core.engine_core.scheduler
        original = scheduler.schedule
    except AttributeError:
        return False

    def schedule(*a, **k):
        so = original(*a, **k)
        scheduled.update(internal.get(r, r) for r in so.num_scheduled_tokens)
        return so

    scheduler.schedule = schedule
    return True


def run_schedule(engine, materials: Materials, deadline_s: float) -> tuple:
    """The finding's schedule, each event applied before the engine step kvfuzz applied it at."""
    schedule = FINDING["schedule"]
    pending = list(FINDING["relative_cancels"])
    out: dict = {}
    children: dict = {}
    live: set = set()
    internal: dict = {}
    scheduled: set = set()
    applied: list = []
    watched = watch_scheduler(engine, scheduled, internal) if pending else False
    for rel, source in FINDING["initial_copies"]:
        materials.copy(rel, source)
    step = cursor = 0
    crash = None
    t0 = time.monotonic()

    def cancel(rid: str) -> None:
        if rid not in live:
            say(f"  step {step}: cancel {rid} (no effect: not running)")
            return
        engine.abort_request([rid])
        live.discard(rid)
        for c in children[rid]:
            if out[c].end is None:
                out[c].cancelled, out[c].end, out[c].finish_reason = True, step, "abort"
        say(f"  step {step}: cancel {rid}")

    while True:
        while cursor < len(schedule) and schedule[cursor]["step"] <= step:
            ev = schedule[cursor]
            cursor += 1
            op = ev["op"]
            if op == "send":
                s = ev["send"]
                say(f"  step {step}: send {s['id']} ({'adapter ' + s['adapter'] if s['adapter'] else 'base'}, "
                    f"{len(FINDING['prompts'][s['prompt']])} tokens, max_tokens {s['max_tokens']})")
                iid = engine.add_request(s["id"], vllm_prompt(materials, s), sampling_params(s),
                                         lora_request=lora_request(materials, s["lora"]),
                                         **({"priority": s["priority"]} if s["priority"] else {}))
                iid = iid if isinstance(iid, str) else s["id"]
                internal[iid] = s["id"]
                live.add(s["id"])
                children[s["id"]] = s["completions"]
                for k, c in enumerate(s["completions"]):
                    if s["n"] > 1:
                        internal[f"{k}_{iid}"] = c
                    out[c] = Outcome(c, s)
                    out[c].sent = step
                applied.append(("send", s["id"], step))
            elif op == "cancel":
                cancel(ev["id"])
                applied.append(("cancel", ev["id"], step))
            elif op == "reset":
                running = ev["reset_running_requests"]
                try:
                    done = engine.reset_prefix_cache(**({"reset_running_requests": True} if running else {}))
                except Exception as e:  # noqa: BLE001 - vLLM's own error: the engine's state is unknown now
                    traceback.print_exc()
                    crash = f"reset_prefix_cache before engine step {step} raised {type(e).__name__}: {e}"
                    crash = crash.splitlines()[0]
                    break
                say(f"  step {step}: reset the prefix cache" + (" (preempting running requests)" if running else "")
                    + ("" if done or done is None else ": declined (blocks held)"))
                applied.append(("reset", "", step))
            elif op in ("load", "reload"):
                for rel, source in ev["copies"]:
                    materials.copy(rel, source)
                name, lora_id, spec, inplace = ev["lora"]
                say(f"  step {step}: {op} adapter {name} (id {lora_id}, {materials.path(spec)}"
                    + (", load_inplace" if inplace else "") + ")")
                engine.add_lora(lora_request(materials, ev["lora"]))
                applied.append((op, ev["name"], step))
            else:
                say(f"  step {step}: unload adapter {ev['name']} (id {ev['lora_id']})")
                engine.remove_lora(ev["lora_id"])
                applied.append(("unload", ev["name"], step))
        if crash is not None:
            break
        still = []
        for rc in pending:
            o = out.get(rc["id"])
            ran = rc["id"] in scheduled or (not watched and o is not None and o.sent is not None and o.sent < step)
            due = (o is not None and ran and len(o.tokens) >= rc["after_tokens"]
                   and (rc["step"] is None or step >= rc["step"]))
            if due or (o is not None and rc["id"] not in live):
                cancel(rc["id"])
                applied.append(("cancel", rc["id"], step))
            else:
                still.append(rc)
        pending = still
        if not engine.has_unfinished_requests():
            if cursor >= len(schedule):
                break
            step = max(step, schedule[cursor]["step"])  # idle: the clock jumps to the next event
            continue
        if step >= FINDING["max_steps"] or time.monotonic() - t0 > deadline_s:
            crash = f"hang: requests unfinished at engine step {step}"
            engine.abort_request(sorted(live))
            break
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - the engine died: that is the finding's verdict
            traceback.print_exc()
            crash = f"engine step {step} raised {type(e).__name__}: {e}".splitlines()[0]
            break
        collect(outputs, children, out, step, live)
        step += 1
    say(f"  the schedule ran {step} engine steps in {time.monotonic() - t0:.1f} s"
        + (f"; {crash}" if crash else ""))
    return out, applied, crash


def run_reference(materials: Materials, rid: str) -> Outcome:
    """``rid`` alone on a fresh engine: its reference."""
    ref = FINDING["references"][rid]
    say(f"repro: reference of {rid}: alone on a fresh engine")
    engine = new_engine(FINDING["reference_engine"], materials.model)
    o = Outcome(rid, ref)
    live = {rid}
    try:
        engine.add_request(rid, vllm_prompt(materials, ref), sampling_params(ref),
                           lora_request=lora_request(materials, ref["lora"]))
        for step in range(FINDING["max_steps"]):
            collect(engine.step(), {rid: [rid]}, {rid: o}, step, live)
            if not engine.has_unfinished_requests():
                break
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        fail(f"the reference run of {rid} failed: {type(e).__name__}: {e}".splitlines()[0])
    finally:
        close_engine(engine)
    return o


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--only", action="append", metavar="REQUEST_ID", help="judge only this request (repeatable)")
    ap.add_argument("--workdir", help="build the model files here and keep them (default: a temporary directory)")
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds the schedule may run (default 600)")
    args = ap.parse_args(argv)
    victims = select_victims(args.only)
    # Before vLLM and torch are imported: the engine core steps in this process (step-exact),
    # as kvfuzz ran it (one OpenMP thread, numba's own thread pool for ngram drafting).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("KVFUZZ_TOGGLES", None)  # vLLM as shipped, even where kvfuzz's vLLM plugin is installed
    try:
        import vllm
    except ImportError as e:
        fail(f"vLLM is not importable here: {e}")
    say(f"repro: {FINDING['source']} on vLLM {getattr(vllm, '__version__', '?')}"
        + (f" (kvfuzz recorded it on {FINDING['recorded_vllm']})" if FINDING["recorded_vllm"] else ""))
    with workdir(args.workdir) as root:
        materials = Materials(root)
        say(f"repro: the schedule ({len(sends())} requests) on a fresh engine")
        engine = new_engine(FINDING["engine"], materials.model)
        try:
            outcomes, applied, crash = run_schedule(engine, materials, args.deadline)
        finally:
            close_engine(engine)
        references = {}
        for cid in victims:
            rid = send_of(cid)
            o = outcomes.get(cid)
            if rid in references or o is None or (crash is not None and o.end is None):
                continue
            references[rid] = run_reference(materials, rid)
        return report(victims, outcomes, references, applied, crash)
'''


SERVER = r'''
# -- the server form: vLLM's OpenAI-compatible server, wall-clock offsets (best-effort) ------------------


class Target:
    def __init__(self, url: str, api_key: str | None) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "") or not u.hostname:
            say(f"repro: error: --url {url!r}: an http://HOST:PORT URL")
            raise SystemExit(2)
        self.url = url.rstrip("/")
        self.host, self.port, self.prefix = u.hostname, u.port or 80, u.path.rstrip("/")
        self.api_key = api_key

    def headers(self) -> dict:
        h = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def call(self, method: str, path: str, body=None, timeout: float = 300.0) -> tuple:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request(method, self.prefix + path, body=None if body is None else json.dumps(body),
                         headers=self.headers())
            r = conn.getresponse()
            return r.status, r.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def healthy(self) -> bool:
        try:
            return self.call("GET", "/health", timeout=2.0)[0] == 200
        except OSError:
            return False


class Server:
    """A vLLM server this script started: its process group, log and URL."""

    def __init__(self, materials: Materials, flags: list, root: Path, label: str, start_timeout: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", materials.model,
               "--served-model-name", FINDING["model_name"], "--host", "127.0.0.1", "--port", str(port), *flags]
        initial = FINDING["initial_adapters"]
        if initial:
            cmd += ["--lora-modules", *(f"{n}={materials.path(b[2])}" for n, b in sorted(initial.items()))]
        env = {k: v for k, v in os.environ.items()
               if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CONFIGURE_LOGGING", "KVFUZZ_TOGGLES")}
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if FINDING["lora"]:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        self.log = root / f"server-{label}.log"
        say(f"repro: starting a vLLM server on port {port} (log {self.log})")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.target = Target(f"http://127.0.0.1:{port}", None)
        deadline = time.monotonic() + start_timeout
        while not self.target.healthy():
            if self.proc.poll() is not None:
                fail(f"the vLLM server exited with status {self.proc.returncode} while starting (log: {self.log})")
            if time.monotonic() > deadline:
                self.stop()
                fail(f"the vLLM server did not answer /health within {start_timeout:g} s (log: {self.log})")
            time.sleep(0.5)

    def died(self) -> str | None:
        rc = self.proc.poll()
        return None if rc is None else f"the vLLM server exited with status {rc} (log: {self.log})"

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def tokens_of(choice: dict) -> tuple:
    lp = choice.get("logprobs") or {}
    tokens = []
    for t in lp.get("tokens") or []:
        if not str(t).startswith("token_id:"):
            raise ValueError(f"token {t!r} is not 'token_id:N' (return_tokens_as_token_ids ignored?)")
        tokens.append(int(str(t)[len("token_id:"):]))
    tops = []
    for pos in lp.get("top_logprobs") or []:
        items = sorted(((int(str(k).split(":", 1)[1]), float(v)) for k, v in (pos or {}).items()), key=lambda kv: -kv[1])
        tops.append(items[:2])
    return tokens, tops, choice.get("finish_reason")


def encode_embeds(tensor) -> str:
    import base64
    import io

    import torch

    buf = io.BytesIO()
    torch.save(tensor.detach().cpu().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def request_body(materials: Materials, send: dict, model: str, *, stream: bool) -> dict:
    body = {"model": model, **dict(send["body"]), "stream": stream}
    if send["embeds"] is None:
        body["prompt"] = list(FINDING["prompts"][send["prompt"]])
    else:
        body["prompt_embeds"] = encode_embeds(embeds_tensor(materials.model, send))
    if not stream:
        body.pop("prompt_logprobs", None)
    return body


class Request(threading.Thread):
    """One streamed /v1/completions request; a cancel closes its connection."""

    def __init__(self, target: Target, body: dict, outcomes: list, clock, timeout: float) -> None:
        super().__init__(daemon=True)
        self.target, self.body, self.outcomes, self.clock, self.timeout = target, body, outcomes, clock, timeout
        self.written = threading.Event()
        self.resolved = threading.Event()
        self.relative: list = []  # (after_tokens, floor_ms)
        self.conn = None
        self.done = False
        self.cancelling = False

    def cancel(self) -> None:
        self.cancelling = True
        for o in self.outcomes:
            if o.end is None:
                o.cancelled, o.finish_reason, o.end = True, "abort", self.clock()
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _relative_due(self) -> bool:
        n = len(self.outcomes[0].tokens)
        return any(n >= after and (floor is None or self.clock() >= floor) for after, floor in self.relative)

    def run(self) -> None:
        first = self.outcomes[0]
        try:
            self.conn = http.client.HTTPConnection(self.target.host, self.target.port, timeout=self.timeout)
            self.conn.request("POST", self.target.prefix + "/v1/completions", body=json.dumps(self.body),
                              headers=self.target.headers())
            for o in self.outcomes:
                o.sent = self.clock()
            self.written.set()
            r = self.conn.getresponse()
            self.resolved.set()
            if r.status != 200:
                first.error = f"HTTP {r.status}: {r.read().decode('utf-8', 'replace')[:300]}"
                return
            if self._relative_due():
                self.cancel()
                return
            for raw in r:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    first.error = f"stream error: {chunk['error']}"
                    break
                for choice in chunk.get("choices") or []:
                    o = self.outcomes[choice.get("index", 0)]
                    tokens, tops, finish = tokens_of(choice)
                    o.tokens.extend(tokens)
                    if o.send["n"] == 1:
                        o.logprobs.extend(tops)
                    if finish:
                        o.finish_reason, o.end = finish, self.clock()
                if self.relative and first.end is None and self._relative_due():
                    self.cancel()
                    return
        except (OSError, http.client.HTTPException, ValueError) as e:
            if not self.cancelling:
                first.error = f"{type(e).__name__}: {e}"
        finally:
            if self.conn is not None:
                self.conn.close()
            for o in self.outcomes:
                if o.end is None and not o.cancelled:
                    o.end = self.clock()
                    o.finish_reason = o.finish_reason or ("error" if first.error else "stop")
                    o.error = o.error or first.error
            self.done = True
            self.written.set()
            self.resolved.set()


def adapter_call(target: Target, op: str, name: str, path: str | None = None) -> str | None:
    if op == "unload":
        status, text = target.call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
    else:
        body = {"lora_name": name, "lora_path": path}
        if op == "reload":
            body["load_inplace"] = True
        status, text = target.call("POST", "/v1/load_lora_adapter", body)
    return None if status == 200 else f"HTTP {status}: {text[:300]}"


def reset_prefix_cache(target: Target) -> bool:
    for _ in range(50):
        status, text = target.call("POST", "/reset_prefix_cache")
        if status in (404, 405, 401, 403):
            return False
        if status == 200:
            return True
        time.sleep(0.1)
    return False


def wait_idle(target: Target, timeout: float = 30.0) -> None:
    """Until /metrics shows no running or waiting request (cancelled streams end asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            status, text = target.call("GET", "/metrics", timeout=10.0)
        except OSError:
            return
        if status != 200:
            return
        busy = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                with contextlib.suppress(ValueError):
                    busy += float(line.rsplit(" ", 1)[-1])
        if busy == 0:
            return
        time.sleep(0.1)


def warm_up(target: Target, timeout: float) -> None:
    """A tiny request on the base model and on each adapter, one at a time: a first forward pass
    (and an adapter's first load) takes seconds and would skew the schedule's timing."""
    for model in [FINDING["model_name"], *sorted(FINDING["initial_adapters"])]:
        target.call("POST", "/v1/completions", {"model": model, "prompt": [16, 17, 18, 19], "max_tokens": 2,
                                                "temperature": 0.0}, timeout=max(timeout, 300.0))


def run_schedule(target: Target, materials: Materials, timeout: float) -> tuple:
    """The finding's schedule at its wall-clock offsets (in planned order, one dispatcher)."""
    schedule = FINDING["schedule"]
    relative: dict = {}
    for rc in FINDING["relative_cancels"]:
        relative.setdefault(rc["id"], []).append((rc["after_tokens"], rc["floor_ms"]))
    reqs: dict = {}
    outcomes: dict = {}
    applied: list = []
    t0 = time.monotonic() + 0.05

    def clock() -> float:
        return (time.monotonic() - t0) * 1000.0

    for ev in schedule:
        delay = (t0 + ev["offset_ms"] / 1000.0) - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        op = ev["op"]
        if op == "send":
            s = ev["send"]
            model = s["adapter"] if s["adapter"] else FINDING["model_name"]
            outs = [Outcome(c, s) for c in s["completions"]]
            outcomes.update({o.id: o for o in outs})
            r = Request(target, request_body(materials, s, model, stream=True), outs, clock, timeout)
            r.relative = relative.get(s["id"], [])
            reqs[s["id"]] = r
            r.start()
            r.written.wait(timeout)
            say(f"  {clock():8.1f} ms: send {s['id']} (planned {ev['offset_ms']:.0f} ms)")
            applied.append(("send", s["id"], outs[0].sent if outs[0].sent is not None else clock()))
        elif op == "cancel":
            r = reqs.get(ev["id"])
            live = r is not None and not r.done
            say(f"  {clock():8.1f} ms: cancel {ev['id']}" + ("" if live else " (no effect: not running)"))
            if live:
                r.cancel()
            applied.append(("cancel", ev["id"], clock()))
        elif op == "reset":
            query = "?reset_running_requests=true" if ev["reset_running_requests"] else ""
            when = clock()
            status, text = target.call("POST", "/reset_prefix_cache" + query)
            say(f"  {when:8.1f} ms: reset the prefix cache: HTTP {status} {text[:100]}")
            applied.append(("reset", "", when))
        else:
            name = ev["name"]
            for sid, r in reqs.items():  # sends on this adapter planned before it: answered first
                if r.outcomes[0].send["adapter"] == name:
                    (r.resolved if op == "unload" else r.written).wait(timeout)
            when = clock()
            if op == "unload":
                err = adapter_call(target, "unload", name)
            else:
                for rel, source in ev["copies"]:
                    materials.copy(rel, source)
                err = adapter_call(target, op, name, materials.path(ev["lora"][2]))
            say(f"  {when:8.1f} ms: {op} adapter {name}" + (f" FAILED: {err}" if err else ""))
            applied.append((op, name, when))
    for r in reqs.values():
        r.join(timeout)
    return outcomes, applied


def reference(target: Target, materials: Materials, rid: str, timeout: float, runtime_lora: bool) -> Outcome:
    """``rid`` alone after /reset_prefix_cache; its adapter's weights at admission loaded under a
    temporary name."""
    ref = FINDING["references"][rid]
    wait_idle(target)
    if not reset_prefix_cache(target):
        say("repro: note: /reset_prefix_cache is not available (VLLM_SERVER_DEV_MODE=1): the reference may "
            "reuse KV cached by the run")
    model, temp = FINDING["model_name"], None
    if ref["lora"] is not None:
        model = ref["adapter"]
        if runtime_lora:
            temp = f"repro-ref-{rid}"
            adapter_call(target, "unload", temp)
            err = adapter_call(target, "load", temp, materials.path(ref["lora"][2]))
            if err is None:
                model = temp
            else:
                say(f"repro: note: cannot load the reference's adapter under a temporary name ({err}); using "
                    f"{model!r} as the server serves it now")
                temp = None
    o = Outcome(rid, ref)
    try:
        status, text = target.call("POST", "/v1/completions", request_body(materials, ref, model, stream=False),
                                   timeout=timeout)
    except OSError as e:
        fail(f"the reference request of {rid} failed: {type(e).__name__}: {e}")
    if status != 200:
        fail(f"the reference request of {rid} failed: HTTP {status}: {text[:300]}")
    for choice in json.loads(text).get("choices") or []:
        if choice.get("index", 0) == 0:
            o.tokens, o.logprobs, o.finish_reason = tokens_of(choice)
            o.finish_reason = o.finish_reason or "stop"
    if temp is not None:
        adapter_call(target, "unload", temp)
    return o


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--url", help="a vLLM server to drive (default: start one with the finding's engine flags)")
    ap.add_argument("--reference-url", help="with --url and speculative decoding: a server without it for the "
                                            "references (default: --url)")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="the servers' API key")
    ap.add_argument("--only", action="append", metavar="REQUEST_ID", help="judge only this request (repeatable)")
    ap.add_argument("--workdir", help="build the model files here and keep them (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take (default 300)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    args = ap.parse_args(argv)
    victims = select_victims(args.only)
    os.environ.pop("KVFUZZ_TOGGLES", None)  # vLLM as shipped, even where kvfuzz's vLLM plugin is installed
    say(f"repro: {FINDING['source']} through vLLM's OpenAI-compatible server (best-effort: wall-clock timing)"
        + (f"; kvfuzz recorded it on {FINDING['recorded_vllm']}" if FINDING["recorded_vllm"] else ""))
    server = None
    with workdir(args.workdir) as root:
        materials = Materials(root)
        for rel, source in FINDING["initial_copies"]:
            materials.copy(rel, source)
        try:
            if args.url:
                target = Target(args.url, args.api_key)
                if not target.healthy():
                    fail(f"{args.url}/health does not answer 200")
                for name, b in sorted(FINDING["initial_adapters"].items()):
                    if b[2][0] == "work":  # reloaded in place later: served from this run's working copy
                        adapter_call(target, "unload", name)
                        err = adapter_call(target, "load", name, materials.path(b[2]))
                        if err:
                            fail(f"cannot bind adapter {name} to its working copy: {err}")
            else:
                server = Server(materials, FINDING["server_flags"], root, "run", args.start_timeout)
                target = server.target
            warm_up(target, args.timeout)
            wait_idle(target)
            reset_prefix_cache(target)
            say(f"repro: the schedule ({len(sends())} requests)")
            outcomes, applied = run_schedule(target, materials, args.timeout)
            crash = server.died() if server is not None else None
            if crash is None and not target.healthy():
                crash = "the server stopped answering /health"
            need = [send_of(c) for c in victims if c in outcomes and (crash is None or outcomes[c].end is not None)]
            references = {}
            if need:
                runtime_lora = FINDING["lora"]  # a --url server without the endpoints: a note, then its own name
                if server is not None and (FINDING["speculative"] or crash is not None):
                    server.stop()
                    flags = FINDING["reference_server_flags"] if FINDING["speculative"] else FINDING["server_flags"]
                    server = Server(materials, flags, root, "reference", args.start_timeout)
                    target = server.target
                elif args.url and FINDING["speculative"]:
                    if args.reference_url:
                        target = Target(args.reference_url, args.api_key)
                    else:
                        say("repro: note: the references run on --url with its speculative decoding on "
                            "(give --reference-url for a server without it)")
                for rid in dict.fromkeys(need):
                    say(f"repro: reference of {rid}: alone")
                    references[rid] = reference(target, materials, rid, args.timeout, bool(runtime_lora))
        finally:
            if server is not None:
                server.stop()
        return report(victims, outcomes, references, applied, crash)
'''


ENTRY = r'''
if __name__ == "__main__":
    try:
        code = main()
    except KeyboardInterrupt:
        code = 130
    except Exception:  # noqa: BLE001 - a failure of the script is not a verdict (exit 1 is)
        traceback.print_exc()
        say("repro: error: the script failed (traceback above); this is not a verdict")
        code = 3
    sys.exit(code)
'''

