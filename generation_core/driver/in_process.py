"""The in-process dispatcher: the whole run in this process, shard after shard (library use,
notebooks, tests). The run's sequence is the driver's (generation_core/driver/run_driver.py), the same as
the Prefect flow's: progress is shown and a Ctrl-C stops the run cleanly here too. Both
dispatchers only submit `run_shard_job`, which alone decides whether a shard needs work."""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any

from generation_core.driver.run_driver import ShardEnded, ShardJobArgs, drive_run, stopped_message
from generation_core.interrupt import STOP, Stopped
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.serving.ray_setup import start_ray
from generation_core.shard.job import run_shard_job
from generation_core.shard.progress import ShardStopped
from generation_core.store.run_folder import SuccessMarker


def run_in_process(plan: RunPlan) -> dict[str, Any]:
    """Generate every missing trajectory, merge, publish; returns the run summary. Called from
    the main thread, a first Ctrl-C stops the run as `genrun`'s does (what has finished is
    committed, the lease released) and raises `interrupt.Stopped` (a KeyboardInterrupt) saying
    what is kept; a second exits at once."""
    started = time.perf_counter()
    with STOP.handling():
        summary = drive_run(plan, ShardsInThisProcess(plan), started=started)
    if summary is None:
        raise Stopped(stopped_message(plan))
    return summary


class ShardsInThisProcess:
    """The in-process shard submitter (driver.ShardSubmitter): `run_shard_job` for one shard
    after another, in a thread of this process, so that the driver's thread stays free to show
    progress and hear a Ctrl-C. Ray is started here when the caller has not started it (the
    progress board and the replicas are Ray actors); a shard job's error is raised by the
    driver's next wait, as is: a library caller gets the error itself, not a count of failures."""

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self.job: ShardJobArgs | None = None
        self.lock = threading.Lock()
        self.waiting: collections.deque[ShardSpec] = collections.deque()
        self.owed: set[int] = set()
        self.ended: queue.Queue[ShardEnded | BaseException] = queue.Queue()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> ShardsInThisProcess:
        start_ray(self.plan.cfg, self.plan.fingerprint)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        with self.lock:
            self.waiting.clear()  # a job still running after the grace period ends with the replicas

    def submit(self, job: ShardJobArgs) -> list[SuccessMarker]:
        self.job = job
        with self.lock:
            self.waiting.extend(self.plan.shards)
            self.owed.update(shard.shard_id for shard in self.plan.shards)
        return []

    def pending(self) -> int:
        with self.lock:
            return len(self.owed)

    def stop(self, started: set[int]) -> None:
        with self.lock:
            cancelled = [shard for shard in self.waiting if shard.shard_id not in started]
            for shard in cancelled:
                self.waiting.remove(shard)
                self.owed.discard(shard.shard_id)

    def next_ended(self, timeout: float) -> ShardEnded | None:
        if self.thread is None:
            # Started by the driver's first wait, once the replicas are up: a thread cannot be
            # cancelled, and a job started beside a boot that then fails would wait for the pool
            # for half an hour.
            self.thread = threading.Thread(target=self._run_shards, name="genrun-shard-jobs", daemon=True)
            self.thread.start()
        try:
            ended = self.ended.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(ended, BaseException):
            raise ended
        with self.lock:
            self.owed.discard(ended.shard.shard_id)
        return ended

    def _run_shards(self) -> None:
        assert self.job is not None, "submit() first"
        job = self.job
        while True:
            with self.lock:
                if not self.waiting:
                    return
                shard = self.waiting.popleft()
            try:
                marker = run_shard_job(
                    self.plan,
                    shard,
                    registry_name=job.registry_name,
                    lease_generation=job.lease_generation,
                    progress_board=job.progress_board,
                )
            except ShardStopped as stopped:
                self.ended.put(ShardEnded(shard, None, str(stopped)))
            except BaseException as error:  # noqa: BLE001 - handed to the driver's thread, which raises it
                with self.lock:
                    self.waiting.clear()
                self.ended.put(error)
                return
            else:
                self.ended.put(ShardEnded(shard, marker))
