"""Talking to a vLLM OpenAI server: the wire format (wire.py), the real-time trace replayer
(replay.py), synchronous control calls (control.py), and the Engine base both HTTP engines
share (engine.py)."""
