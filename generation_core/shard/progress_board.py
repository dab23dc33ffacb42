"""The Ray actor a run's shard jobs report their counts to, and the driver reads.

Its own module, importing nothing but the standard library: the actor's process imports the
module that defines its class, and on a 2-core machine the ~6 s of verl and torch imports that
the shard's and driver's modules pull in would be spent while the shards and replicas start beside it.

It also shares out the run's in-flight budget (issue 34 item 5: idle capacity goes to the
stragglers). The budget is max_inflight x the most shard jobs seen generating at once; with each
report the board answers the job its share: that peak over the jobs generating now. While every
worker has a shard the share is 1; as shards finish and no new one comes to take their worker,
the jobs still running take over the freed budget (up to `generation.inflight_share_cap` times
their own: shard/streaming.py follows it), so the replicas stay as busy at the run's end as in its
middle. A job that ended sends a last report marked `ended`; one whose worker died sends none and
stops counting once its last report is STALE_SECONDS old on the board's clock.
"""

from __future__ import annotations

import time
from typing import Any

STALE_SECONDS = 30.0
"""A job that has not reported for this long (its worker died) no longer counts as generating."""


class ProgressBoard:
    """The Ray actor shard jobs report to; the driver reads `snapshot` and may `request_stop`."""

    def __init__(self) -> None:
        self.reports: dict[int, dict[str, Any]] = {}
        self.generated_by_attempt: dict[str, int] = {}
        self.started: set[int] = set()
        """Shards whose job has asked whether to start (`stop_requested`): from then on the
        job answers a stop request itself, by committing what finished."""
        self.stop = False
        self.peak_generating = 0
        """The most shard jobs seen generating at once: the run's in-flight budget, in shards."""
        self.heard: dict[int, float] = {}
        """When each shard's latest report arrived, on this actor's clock (a worker's clock may differ)."""

    def report(self, report: dict[str, Any]) -> dict[str, Any]:
        """Record a shard's report; answers whether the run is stopping and the job's share of
        the run's in-flight budget (1.0: its own max_inflight)."""
        self.reports[report["shard_id"]] = report
        self.heard[report["shard_id"]] = time.time()
        self.generated_by_attempt[report["attempt"]] = report["generated"]
        generating = self.generating()
        self.peak_generating = max(self.peak_generating, generating)
        return {"stop": self.stop, "share": self.peak_generating / generating if generating else 1.0}

    def generating(self, now: float | None = None) -> int:
        """Shard jobs generating now: reported within STALE_SECONDS and not ended."""
        now = time.time() if now is None else now
        return sum(
            1
            for shard_id, r in self.reports.items()
            if not r.get("ended") and now - self.heard[shard_id] < STALE_SECONDS
        )

    def snapshot(self) -> dict[str, Any]:
        return {"reports": list(self.reports.values()), "generated": sum(self.generated_by_attempt.values())}

    def request_stop(self) -> list[int]:
        """Stop the run; answers the shards whose jobs have started. The flag and the answer
        are one actor call, so a job that did not make the list sees the flag when it asks,
        before it generates anything: only those jobs may be cancelled from outside (a
        cancelled job that was generating would lose what had finished but was not committed)."""
        self.stop = True
        return sorted(self.started)

    def stop_requested(self, shard_id: int) -> bool:
        """Whether the run is stopping; asked by a job about to start, naming its shard."""
        self.started.add(shard_id)
        return self.stop
