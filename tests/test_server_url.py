"""The URL engine's reference isolation against servers that do not allow resetting their
prefix cache. A tiny fake OpenAI server (pure logic: which calls kvfuzz makes and what it
records), not vLLM — the real-server path is in test_server.py."""

from __future__ import annotations

import json

import pytest
from http_fakes import JsonHandler, serve

from kvfuzz.harness.url import UrlEngine
from kvfuzz.traces import At, EngineConfig, GenPrompt, SendEvent, Trace


class Fake:
    def __init__(self, *, reject_salt: bool):
        self.reject_salt = reject_salt
        self.bodies: list[dict] = []
        fake = self

        class H(JsonHandler):

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"data": [{"id": "base-model"}, {"id": "a", "parent": "base-model"}]})
                elif self.path == "/health":
                    self._json(200, {})
                else:
                    self._json(404, {"error": "no"})  # no /metrics either

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/v1/completions":
                    self._json(404, {"detail": "Not Found"})
                    return
                fake.bodies.append(body)
                if fake.reject_salt and "cache_salt" in body:
                    self._json(400, {"error": {"message": "Extra inputs are not permitted: cache_salt"}})
                    return
                self._complete(body)

        self.httpd, self.url = serve(H)

    def close(self):
        self.httpd.shutdown()


@pytest.fixture(params=[False, True], ids=["salt-accepted", "salt-rejected"])
def fake(request):
    f = Fake(reject_salt=request.param)
    yield f
    f.close()


def _trace():
    return Trace(engine=EngineConfig(), events=[
        SendEvent(request_id=f"r{i}", at=At(offset_ms=2.0 * i), max_tokens=3, stream=i % 2 == 0,
                  prompt=GenPrompt(length=20, seed=i)) for i in range(3)])


def test_reference_isolation_without_reset(fake):
    eng = UrlEngine(EngineConfig(), fake.url).start()
    assert eng.target.model == "base-model"  # the model without a parent
    t = _trace()
    fake.bodies.clear()
    h = eng.replay(t)
    assert all(r.token_ids == [100, 101, 102] and r.error is None for r in h.requests.values())
    run_salts = {b.get("cache_salt") for b in fake.bodies}
    ref = eng.run_alone(t.sends[0])
    ref_salt = fake.bodies[-1].get("cache_salt")
    assert ref.token_ids == [100, 101, 102]
    if not fake.reject_salt:
        # One fresh salt per run (requests of a run still share prefixes), another per reference.
        assert eng.reference_isolation == "cache_salt"
        assert len(run_salts) == 1 and None not in run_salts
        assert ref_salt is not None and ref_salt not in run_salts
        assert "fresh cache_salt" in eng.reference_note
    else:
        assert eng.reference_isolation == "none"
        assert run_salts == {None} and ref_salt is None
        assert "could not be reset" in eng.reference_note and "may reuse KV" in eng.reference_note
    assert eng.environment().engine_flags["server"]["reference_isolation"] == eng.reference_isolation
