"""The scale-out room: Ray workers and the cluster behind `kvfuzz run --ray` / `kvfuzz gate --ray`, above triage."""
