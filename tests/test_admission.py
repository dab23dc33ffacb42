"""The engine's admission order: a trajectory's later turns before queued first turns."""

import types

import pytest

from generation_core.engines.hf.admission import AdmissionQueue, RequestIds

pytestmark = pytest.mark.timeout(30)


def _request(name: str, later_turn: bool):
    return types.SimpleNamespace(name=name, later_turn=later_turn)


def test_later_turns_come_out_first_and_each_kind_in_arrival_order():
    waiting = AdmissionQueue()
    for name, later in [
        ("first-1", False),
        ("first-2", False),
        ("later-1", True),
        ("first-3", False),
        ("later-2", True),
    ]:
        waiting.put(_request(name, later))
    assert [waiting.get_nowait().name for _ in range(waiting.qsize())] == [
        "later-1",
        "later-2",
        "first-1",
        "first-2",
        "first-3",
    ]
    assert waiting.empty() and waiting.peek() is None


def test_take_removes_what_peek_showed_even_when_a_later_turn_arrived_in_between():
    waiting = AdmissionQueue()
    waiting.put(_request("first-1", False))
    waiting.put(_request("first-2", False))
    shown = waiting.peek()
    # The engine's decode thread decides on `shown` while the event loop thread puts a later turn.
    waiting.put(_request("later-1", True))
    waiting.take(shown)
    assert shown.name == "first-1"
    assert [waiting.get_nowait().name for _ in range(waiting.qsize())] == ["later-1", "first-2"]
    with pytest.raises(RuntimeError, match="not at the head"):
        waiting.take(shown)


def test_request_ids_tell_a_later_turn_and_forget_the_oldest_beyond_capacity():
    ids = RequestIds(capacity=2)
    assert [ids.seen_before(i) for i in ("a", "b", "a", "c")] == [False, False, True, False]
    # "b" was the least recently seen when "c" came: forgotten; "a" is kept.
    assert ids.seen_before("a") and not ids.seen_before("b")
