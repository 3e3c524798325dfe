"""The bench room: `kvfuzz bench`, campaigns per seed until a fault is detected (time to detection), above triage."""
