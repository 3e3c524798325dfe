"""vLLM's Prometheus ``/metrics``: parse the text format and keep the samples a history needs.

A server run cannot observe scheduler steps the way the in-process engine does; the counters
before and after a run (preemptions, prefix-cache queries/hits, cached prompt tokens, aborted
requests) and the gauges (running/waiting, KV usage) are what tells a reader whether the run
exercised preemption or prefix sharing at all.
"""

from __future__ import annotations

import math
import re

# Samples kept in History.metrics_before/after (summed over label sets, e.g. per engine).
KEPT = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    # Tokens a KV connector supplied (external prefix cache; docs/hybrid.md).
    "vllm:external_prefix_cache_hits_total",
)
# vllm:request_success_total is split by finished_reason; kept per reason.
_SUCCESS = "vllm:request_success_total"

_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of a Prometheus text exposition."""
    out: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        out.append((m.group("name"), labels, value))
    return out


def summarize(text: str) -> dict[str, float]:
    """The kept samples of one scrape, summed over label sets; missing metrics are absent."""
    acc: dict[str, float] = {}
    for name, labels, value in parse_prometheus(text):
        if math.isnan(value):
            continue
        if name in KEPT:
            acc[name] = acc.get(name, 0.0) + value
        elif name == _SUCCESS:
            key = f"{name}{{finished_reason={labels.get('finished_reason', '')}}}"
            acc[key] = acc.get(key, 0.0) + value
    return acc


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float | None:
    """after - before of one counter, or None if either scrape lacks it."""
    if name not in before or name not in after:
        return None
    return after[name] - before[name]


def busy(sample: dict[str, float]) -> int | None:
    """Requests the server still holds (running + waiting); None if the scrape lacks both."""
    keys = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    if not any(k in sample for k in keys):
        return None
    return int(sum(sample.get(k, 0.0) for k in keys))
