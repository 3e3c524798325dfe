"""The trace generator: random generation, mutation operators, Hypothesis strategies, corpus
and campaign loop. Importing it needs neither torch nor vLLM."""

from .campaign import CampaignOptions, CampaignState, run_campaign, trace_seed
from .generate import EMBEDDED_ADAPTERS, GenOptions, default_engine, generate

__all__ = ["CampaignOptions", "CampaignState", "EMBEDDED_ADAPTERS", "GenOptions", "default_engine", "generate",
           "run_campaign", "trace_seed"]
