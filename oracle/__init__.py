"""The oracle: diff temperature-0 outputs against references and across runs, classify each
divergence, and package findings. Pure Python over recorded histories: no torch, no vLLM."""

from .check import ENGINE, check, classify_run, divergent
from .diff import Comparison, compare, first_divergence
from .finding import make_finding
from .noise import NoiseBounds, bounds_from, default_bounds
from .stats import wilson

__all__ = ["ENGINE", "Comparison", "NoiseBounds", "bounds_from", "check", "classify_run", "compare",
           "default_bounds", "divergent", "first_divergence", "make_finding", "wilson"]
