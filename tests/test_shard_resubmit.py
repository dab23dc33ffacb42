"""The flow's shard submitter (flows/generate.py ShardTasksOnRay) submits a crashed shard again
after generation.retry_delay_seconds without holding up the driver's loop: progress, the stall
watch and a first Ctrl-C are answered meanwhile (review 2026-11-28 §6.7). Prefect and Ray are
replaced by stand-ins: what is tested is the submitter's bookkeeping, on a fake clock."""

from __future__ import annotations

import queue
import types
import uuid

import pytest

import flows.generate as generate
from generation_core.run_plan import ShardSpec

pytestmark = pytest.mark.timeout(60)


class _CrashedFuture:
    """A shard task whose worker died (Prefect's Crashed state)."""

    def __init__(self) -> None:
        self.task_run_id = uuid.uuid4()
        self.state = types.SimpleNamespace(
            is_crashed=lambda: True,
            is_failed=lambda: False,
            is_completed=lambda: False,
            name="Crashed",
            message="worker died",
        )

    def wait(self) -> None:
        pass


def _submitter(monkeypatch, clock: list[float], slept: list[float], submitted: list[tuple[int, int]]):
    monkeypatch.setattr(generate, "time", types.SimpleNamespace(monotonic=lambda: clock[0], sleep=slept.append))
    monkeypatch.setattr(generate, "record_crash", lambda *args: None)
    tasks = object.__new__(generate.ShardTasksOnRay)  # no Prefect runner, no Ray
    tasks.plan = types.SimpleNamespace(settings=types.SimpleNamespace(retry_delay_seconds=5.0))
    tasks.futures, tasks.finished, tasks.reported, tasks.stopping = {}, queue.Queue(), [], False
    tasks.resubmit_at = []
    tasks._submit = lambda shard, retries, marker=None: submitted.append((shard.shard_id, retries))
    return tasks


def test_a_crashed_shard_is_submitted_again_after_the_delay_without_blocking_the_driver(monkeypatch):
    clock, slept, submitted = [1000.0], [], []
    tasks = _submitter(monkeypatch, clock, slept, submitted)
    crashed = _CrashedFuture()
    tasks.futures[crashed] = (ShardSpec(shard_id=3, start=0, end=10), 2)
    tasks.finished.put(crashed)

    assert tasks.next_ended(0.01) is None
    assert slept == [], "the driver's loop slept the retry delay"
    assert submitted == [] and tasks.pending() == 1, "the shard waits out its delay, still pending"
    clock[0] += 4.0
    assert tasks.next_ended(0.01) is None and submitted == []
    clock[0] += 1.0
    assert tasks.next_ended(0.01) is None
    assert submitted == [(3, 1)], "submitted again once due, with one retry fewer"
    assert tasks.pending() == 0, "its new future (the stand-in keeps none) is what is pending now"


def test_a_stop_drops_the_resubmission_not_started_yet(monkeypatch):
    clock, slept, submitted = [1000.0], [], []
    tasks = _submitter(monkeypatch, clock, slept, submitted)
    crashed = _CrashedFuture()
    tasks.futures[crashed] = (ShardSpec(shard_id=0, start=0, end=10), 1)
    tasks.finished.put(crashed)
    assert tasks.next_ended(0.01) is None and tasks.pending() == 1
    tasks.stop(set())
    clock[0] += 10.0
    assert tasks.next_ended(0.01) is None
    assert (submitted, tasks.pending(), slept) == ([], 0, [])
