"""What the shard job needs of its prompts and its worker, and where it gets them: the job's three
seams, each a Protocol (as the driver's `ShardSubmitter` is).

- `ShardPrompts`: a shard's rows as the job streams them (inputs/shard_rows.py's DatasetPrompts
  reads them from the dataset and filters them as verl does).
- `StreamWorker`: runs samples and yields each result as it finishes (shard/streaming.py's
  StreamingWorker, over verl's agent loops and the replica pool).
- `WorkerFactory`: where a job gets both (shard/job.py's PoolWorkers: the run's dataset and
  replica pool). A library caller or a test hands `run_shard_job` its own, and the job runs
  exactly as it does in a run: one decision, one attempt, one marker.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.shard.call_slots import SampleKey
from generation_core.store.trajectory_record import SampleFailure, TrajectoryRecord


class ShardPrompts(Protocol):
    """A shard's raw rows, in the order the job dispatches them, each decided by the overlong
    filter just before it is dispatched."""

    @property
    def num_rows(self) -> int: ...

    @property
    def dispatch_rows(self) -> Sequence[int]:
        """The raw rows in dispatch order."""
        ...

    @property
    def rows_digest(self) -> str | None:
        """sha256 of the shard's raw rows, recorded by its first attempt (None: not checked)."""
        ...

    @property
    def filtered_overlong(self) -> int:
        """Rows decided so far to be longer than data.max_prompt_length: never generated."""
        ...

    def row_index(self, row: int) -> int:
        """Raw row `row`'s sample id (`extra_info.index`)."""
        ...

    def keeps(self, row: int) -> bool:
        """Whether the overlong filter keeps raw row `row` (decided at the first ask)."""
        ...

    def row_kwargs(self, row: int) -> dict[str, Any]:
        """Raw row `row`'s agent-loop keyword arguments (a fresh dict each call)."""
        ...


class StreamWorker(Protocol):
    """Runs a shard's samples and hands each on as it finishes."""

    provenance: dict[str, Any]
    """What every trajectory it makes records of where it was made; the job sets `model_digest`
    and `attempt`."""
    postprocess_seconds: float
    """Seconds spent turning agent-loop outputs into records so far (the stage breakdown)."""

    @property
    def peak_calls_in_flight(self) -> int:
        """The most model calls its streams had in flight at once."""
        ...

    def stream(
        self,
        samples: Iterable[tuple[SampleKey, dict[str, Any]]],
        max_inflight: int,
        idle_timeout: float,
        max_open: int | None = None,
        scale: Callable[[], float] | None = None,
    ) -> AsyncGenerator[TrajectoryRecord | SampleFailure | None, None]:
        """Each sample's record or failure as it finishes; None after `idle_timeout` seconds
        without either (shard/sample_stream.py says what the limits mean)."""
        ...

    def engine_counters(self) -> dict[str, int]:
        """`requests`, `request_retries` and `replica_failures` so far (the marker's engine stats)."""
        ...


class WorkerFactory(Protocol):
    """Where a shard job gets its prompts and its worker."""

    def prompts(self, plan: RunPlan, shard: ShardSpec) -> ShardPrompts:
        """The shard's prompts (asked only when the shard has work)."""
        ...

    def worker(self, plan: RunPlan, shard: ShardSpec) -> AbstractAsyncContextManager[StreamWorker]:
        """A worker for one attempt at `shard`, entered in the attempt's event loop: ready to
        stream inside, released (connections, reward pool) at the exit."""
        ...
