"""kvfuzz's versioned data: traces (what to send), histories (what happened), findings.

Importing this package needs neither torch nor vLLM.
"""

from .errors import BadInput, InfraError, KvfuzzError
from .finding import (
    DIVERGENT_CLASSES,
    Ablation,
    BisectRecord,
    ControlResult,
    Divergence,
    Environment,
    Explanation,
    Finding,
    Minimization,
    VersionResult,
)
from .history import EventRecord, History, RequestRecord, Scoring, StepRecord
from .io import (
    atomic_write_text,
    load_any,
    load_finding,
    load_trace,
    parse_finding,
    parse_trace,
    save,
    sweep_partial_writes,
)
from .prompts import expand
from .provenance import (
    Attribution,
    BoundsUsed,
    CampaignOrigin,
    CrashInfo,
    CrashKind,
    GateCase,
    GraftInto,
    LineageLink,
    MinimizedFrom,
    Provenance,
    ReplayOf,
    WorkerDeath,
)
from .trace import (
    EMBEDDED_HYBRID,
    EMBEDDED_MODEL,
    SCHEMA_VERSION,
    At,
    CancelEvent,
    EngineConfig,
    Expectation,
    GenPrompt,
    Lineage,
    LoraSettings,
    PromptEmbeds,
    ResetPrefixCacheEvent,
    Sampling,
    SendEvent,
    Speculative,
    TokenPrompt,
    Trace,
)


def json_schemas() -> dict[str, dict]:
    """JSON Schemas of the trace and finding formats (``kvfuzz schema``)."""
    return {
        "trace": Trace.model_json_schema(),
        "finding": Finding.model_json_schema(by_alias=True),
    }


__all__ = [
    "Ablation", "At", "Attribution", "BoundsUsed", "CampaignOrigin", "CrashInfo", "CrashKind", "GateCase", "GraftInto",
    "LineageLink", "MinimizedFrom", "Provenance", "ReplayOf", "WorkerDeath", "BadInput", "BisectRecord", "CancelEvent", "ControlResult", "DIVERGENT_CLASSES", "Divergence",
    "EMBEDDED_HYBRID", "EMBEDDED_MODEL", "EngineConfig", "Environment", "Expectation", "Explanation", "EventRecord",
    "Finding", "GenPrompt",
    "History", "InfraError", "KvfuzzError", "Lineage", "LoraSettings", "Minimization",
    "PromptEmbeds", "RequestRecord", "ResetPrefixCacheEvent", "SCHEMA_VERSION", "Sampling", "Scoring", "SendEvent", "Speculative", "StepRecord", "TokenPrompt", "Trace", "VersionResult",
    "atomic_write_text", "expand", "json_schemas", "load_any", "load_finding", "load_trace",
    "parse_finding", "parse_trace", "save", "sweep_partial_writes",
]
