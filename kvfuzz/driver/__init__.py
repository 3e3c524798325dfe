"""The driver room: a session runs traces on engines (harness) and hands recordings to the oracle; recovery, calibration, arms and the isolated child session live beside it, below triage."""
