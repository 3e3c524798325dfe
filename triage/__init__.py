"""Triage: the re-runs that explain a finding, a floor above the harness and the oracle.

- ``minimize`` — shrink a finding to the smallest trace that keeps its signature (the passes;
  the pure reducers are ``reduce``), replaying candidates through a ``probe.Replayer``;
- ``controls`` — re-run a finding where a suspected cause is taken away (serialized,
  batch-invariant);
- ``attribution`` — re-run a diverged trace in the clean and single-toggle arms so every
  divergence names the toggle that explains it;
- ``finish`` — what ``kvfuzz run`` does with each new finding.

The oracle judges what these re-runs record; it never runs anything itself.
"""
