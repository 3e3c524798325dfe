"""Block-lifecycle edges (harness/blocks.py): pure bookkeeping over block ids."""

from kvfuzz.fuzzer.feedback import signature
from kvfuzz.harness.blocks import BlockEdges, gap_bucket
from kvfuzz.traces import History, StepRecord


def test_cancel_mid_prefill_then_another_request_takes_the_blocks():
    e = BlockEdges()
    assert e.step(0, {"A": [1, 2, 3]}, no_tokens=["A"]) == []
    assert e.step(1, {}, cancelled=["A"], no_tokens=["A"]) == []  # A cancelled before its first token
    assert e.step(2, {"B": [2, 3, 9]}) == ["reuse:cancel:prefill:1", "reuse:cancel:prefill:1"]


def test_sharing_leave_while_shared_and_same_step_sharing():
    e = BlockEdges()
    e.step(0, {"A": [1, 2]})
    assert e.step(1, {"A": [1, 2], "B": [1, 2, 5]}) == ["share", "share"]
    # A is cancelled while B still holds the shared blocks.
    assert e.step(2, {"B": [1, 2, 5]}, cancelled=["A"]) == ["leave-shared:cancel"]
    assert e.step(3, {"B": [1, 2, 5], "C": [7], "D": [7]}) == ["share:same-step", "share:same-step"]


def test_preempted_request_resumes_on_its_own_blocks_or_on_others():
    e = BlockEdges()
    e.step(0, {"A": [1, 2], "B": [3]})
    assert e.step(1, {"B": [3, 1]}, preempted=["A"]) == ["reuse:preempt:0"]  # B grows into A's block
    assert e.step(5, {"B": [3, 1], "A": [2, 4]}) == ["reclaim:preempt"]
    e.step(6, {"A": [2, 4]})  # B finished
    assert e.step(7, {"A": [2, 4, 3]}) == ["resumed-reuse:finish:1"]


def test_gap_buckets_and_signature_counts_edges():
    assert [gap_bucket(n) for n in (0, 1, 2, 3, 4, 40)] == ["0", "1", "2-3", "2-3", "4+", "4+"]
    h = History(trace_id="t", engine="inprocess", steps=[
        StepRecord(step=0, block_edges=["share", "share"]), StepRecord(step=1, block_edges=["reuse:cancel:0"])])
    sig = signature(h)
    assert "edge:share:2" in sig and "edge:reuse:cancel:0:1" in sig
