"""Shared fixtures. Engine tests use one real in-process vLLM CPU engine for the whole session
(engine start is the dominant cost); a test that needs another engine configuration restarts it
through the same Session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def session(tmp_path_factory):
    from kvfuzz.session import Session

    s = Session(runs=3, log_file=tmp_path_factory.mktemp("engine") / "engine.log")
    yield s
    s.close()


@pytest.fixture(scope="session")
def lora_engine_config():
    from fuzzer import default_engine

    return default_engine(lora=True)
