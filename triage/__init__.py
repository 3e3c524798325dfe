"""Triage: the re-runs that explain a finding (minimization, control arms, attribution, causal
ablation, bisection, a campaign's bucket triage), a floor above the harness and the oracle. The
oracle judges what these re-runs record; it never runs anything itself (docs/architecture.md).
"""
