"""The Ray actor a run's shard jobs report their counts to, and the driver reads.

Its own module, importing nothing but the standard library: the actor's process imports the
module that defines its class, and on a 2-core machine the ~6 s of verl and torch imports that
generation_core.progress pulls in would be spent while the shards and replicas start beside it.
"""

from __future__ import annotations

from typing import Any


class ProgressBoard:
    """The Ray actor shard jobs report to; the driver reads `snapshot` and may `request_stop`."""

    def __init__(self) -> None:
        self.reports: dict[int, dict[str, Any]] = {}
        self.generated_by_attempt: dict[str, int] = {}
        self.stop = False

    def report(self, report: dict[str, Any]) -> bool:
        """Record a shard's report; answers whether the run is stopping."""
        self.reports[report["shard_id"]] = report
        self.generated_by_attempt[report["attempt"]] = report["generated"]
        return self.stop

    def snapshot(self) -> dict[str, Any]:
        return {"reports": list(self.reports.values()), "generated": sum(self.generated_by_attempt.values())}

    def request_stop(self) -> None:
        self.stop = True

    def stop_requested(self) -> bool:
        return self.stop
