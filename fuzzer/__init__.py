"""The trace generator: random generation, mutation operators, Hypothesis strategies, corpus
and campaign loop. Importing it needs neither torch nor vLLM."""

from .campaign import CampaignOptions, CampaignState, run_campaign, trace_seed
from .corpus import Corpus, CorpusEntry
from .feedback import Coverage, signature, trace_signature
from .generate import EMBEDDED_ADAPTERS, GenOptions, default_engine, generate
from .mutate import OPERATORS, mutate

__all__ = ["CampaignOptions", "CampaignState", "Corpus", "CorpusEntry", "Coverage", "EMBEDDED_ADAPTERS",
           "GenOptions", "OPERATORS", "default_engine", "generate", "mutate", "run_campaign", "signature",
           "trace_seed", "trace_signature"]
