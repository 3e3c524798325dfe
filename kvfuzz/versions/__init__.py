"""The versions room: vLLM releases and the uv environments they are replayed in (kvfuzz bisect), below triage."""
