"""One attempt at a shard: its attempt record, the stream of its pending samples into parts and
commit records, and the success marker once every sample it owes is committed or failed.

The shard job (job.py) hands an attempt the shard's commit log as it folded it (and repaired):
the attempt record, every part and, after it, the done record go through that one view.

A sample whose agent loop still fails after the engine-request retries is never committed: it is
written to the shard's failure log (failures/, with its error) and the shard carries on. Once the
stream ends the shard fails if more than `generation.max_failed_fraction` of its trajectories
failed; otherwise its marker counts the failures. Failed samples are pending for every later
attempt or run, which regenerates exactly them.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable, Iterator

from tqdm import tqdm

from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.shard.adaptive import AdaptiveRule, decided_prompts
from generation_core.shard.call_slots import SampleKey
from generation_core.shard.part_writer import PartWriter
from generation_core.shard.progress import ShardReporter, ShardStopped
from generation_core.shard.protocols import ShardPrompts, StreamWorker
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence, LeaseLost
from generation_core.store.run_folder import FAILURES_DIR, AttemptStats, SuccessMarker, shard_file, write_last_error
from generation_core.store.trajectory_record import SampleFailure, TrajectoryRecord, sample_key_text

logger = logging.getLogger(__name__)

# With a progress board, the longest a shard job takes to see a stop request while it waits
# for trajectories.
STOP_CHECK_SECONDS = 1.0


class TooManyFailedSamples(RuntimeError):
    """More samples of a shard failed than generation.max_failed_fraction allows."""


def pending_samples(
    prompts: ShardPrompts, n: int, done: set[str], rollouts: Callable[[int], range] | None = None
) -> Iterator[tuple[SampleKey, dict]]:
    """(sample key, agent-loop kwargs) for every trajectory of the shard not in `done`, in
    dispatch order, decided row by row as the stream pulls: a row none of whose samples is
    committed goes through the overlong filter (`prompts.keeps`) just before it is dispatched;
    a row with a committed sample was kept already. `rollouts(index)`: the rollouts this round
    draws of a prompt (adaptive sampling, shard/adaptive.py; None: all n)."""
    for row in prompts.dispatch_rows:
        index = prompts.row_index(row)
        allowed = range(n) if rollouts is None else rollouts(index)
        todo = [(index, rollout_n) for rollout_n in allowed if sample_key_text((index, rollout_n)) not in done]
        untouched = not todo or all(sample_key_text((index, rollout_n)) not in done for rollout_n in range(n))
        if not todo or (untouched and not prompts.keeps(row)):
            continue
        for key in todo:
            # Each sample its own dict: an agent loop may change what it is given.
            yield key, prompts.row_kwargs(row)


def allowed_failures(owed: int, max_failed_fraction: float) -> int:
    return int(owed * max_failed_fraction + 1e-9)


async def generate_shard(
    plan: RunPlan,
    shard: ShardSpec,
    folder: StorageFolder,
    checkpoint: ShardCheckpoint,
    prompts: ShardPrompts,
    worker: StreamWorker,
    fence: LeaseFence | None,
    reporter: ShardReporter,
) -> tuple[SuccessMarker, ShardCheckpoint]:
    """Generate every trajectory of `shard` its `checkpoint` (the shard's records as the job
    folded them) lacks. Returns the success marker, which the caller writes, and the records it
    follows (the attempt's view: `checkpoint`, unless another writer made the attempt read them
    again). With a `reporter` attached to the run's progress board: counters go there, and a stop
    request commits what has finished and raises ShardStopped."""
    generation = ShardGeneration(plan, shard, folder, checkpoint, prompts, worker, fence, reporter)
    try:
        await generation.stream_and_commit()
        await generation.second_round()
        generation.check_failures()
    except (LeaseLost, ShardStopped):
        raise  # another run holds the folder now, or this run is stopping: no error to record
    except Exception as exc:
        generation.record_error(exc)
        raise
    return generation.success_marker(), generation.checkpoint


class ShardGeneration:
    """One attempt at a shard: its commit record started, the stream of its pending samples, the
    part writer that commits them, and the counters its success marker reports."""

    def __init__(
        self,
        plan: RunPlan,
        shard: ShardSpec,
        folder: StorageFolder,
        checkpoint: ShardCheckpoint,
        prompts: ShardPrompts,
        worker: StreamWorker,
        fence: LeaseFence | None,
        reporter: ShardReporter,
    ):
        self.cfg, self.shard, self.folder, self.prompts, self.worker = plan.cfg, shard, folder, prompts, worker
        self.gen = gen = plan.settings  # decided on the driver, not again here
        self.reporter = reporter
        # The attempt's commit record (under a lease, the run's claim on the shard), with the digest
        # of the shard's rows, on the records the job folded; failed samples of earlier attempts
        # are pending again.
        self.checkpoint = ShardCheckpoint.start_attempt(
            folder, shard.name, fence, rows_digest=prompts.rows_digest, loaded=checkpoint
        )
        self.done = set(self.checkpoint.completed)
        # Every trajectory of this attempt names it.
        worker.provenance["attempt"] = self.checkpoint.attempts
        self.n = plan.cfg.actor_rollout_ref.rollout.n
        self.adaptive = AdaptiveRule.of(gen, self.n)
        self.rollouts = self.adaptive.first_round if self.adaptive else None
        self.not_owed = 0
        """Samples the adaptive rule decided not to draw (known once round 1 is committed)."""
        logger.info("%s: %d rows, %d trajectories committed", shard.name, prompts.num_rows, len(self.done))
        self.started = time.perf_counter()
        self.postprocess_before = worker.postprocess_seconds
        self.engine_before = worker.engine_counters()
        self.generated_now = 0
        self.tokens_now = 0
        self.writer = PartWriter(
            folder,
            shard.name,
            shard.shard_id,
            self.checkpoint,
            fence,
            target_bytes=gen.part_target_bytes,
            max_seconds=gen.part_max_seconds,
            max_records=gen.save_batch_size,
            first_part_max_seconds=gen.first_part_max_seconds,
        )
        # Before the overlong filter has seen every row, what the shard owes is known up to it.
        owed_at_most = prompts.num_rows * self.n
        self.give_up_after = allowed_failures(owed_at_most, gen.max_failed_fraction) + gen.systematic_failure_margin
        report = self.reporter.report
        report.committed_at_start = report.committed = len(self.done)
        report.owed = owed_at_most

    def owed(self) -> int:
        """What the shard owes once the overlong filter has decided every row pulled so far."""
        return (self.prompts.num_rows - self.prompts.filtered_overlong) * self.n - self.not_owed

    async def second_round(self) -> None:
        """Adaptive sampling's round 2, once round 1 drew every prompt and is committed (a round 1 given up on
        failures did not): the rest of each prompt its commit records leave undecided (shard/adaptive.py)."""
        if self.adaptive is None or self.reporter.stop or len(self.checkpoint.failed) >= self.give_up_after:
            return
        decided = await asyncio.to_thread(decided_prompts, self.adaptive, self.folder, self.shard.name, self.checkpoint)
        self.not_owed = len(decided) * (self.n - self.adaptive.k)
        # Failed this attempt: not drawn again in the same attempt (the next attempt retries them).
        self.done = set(self.checkpoint.completed) | set(self.checkpoint.failed)
        self.rollouts = self.adaptive.second_round(decided)
        await self.stream_and_commit()

    async def stream_and_commit(self) -> None:
        """Pull finished trajectories and failures as they come, write them into parts and commit
        them; then commit what is left. A stop request ends it after a commit (ShardStopped)."""
        gen, writer, reporter, report = self.gen, self.writer, self.reporter, self.reporter.report
        # The per-shard bar is for a process whose output someone reads (library use); on a Ray
        # worker the driver shows the run's progress from the board instead.
        progress = tqdm(
            total=report.owed,
            initial=len(self.done),
            desc=self.shard.name,
            disable=not gen.show_progress or reporter.attached,
            unit="traj",
        )
        samples = pending_samples(self.prompts, self.n, self.done, self.rollouts)
        # An idle stream still wakes up in time to commit a part that reached its maximum age (and,
        # with a board, to see a stop request within a second).
        idle_timeout = min(
            gen.pull_timeout, writer.first_part_max_seconds, *([STOP_CHECK_SECONDS] if reporter.attached else [])
        )
        stream = self.worker.stream(
            samples,
            gen.inflight_limit,
            idle_timeout=idle_timeout,
            max_open=gen.open_trajectories_limit,
            scale=lambda: min(reporter.share, gen.inflight_share_cap),
        )
        try:
            async with reporter.reporting():
                async for record in stream:
                    if not await self._take(record, progress) or reporter.stop:
                        break
                await to_thread_to_the_end(writer.commit)
                report.committed = len(set(self.checkpoint.completed))
            if reporter.stop:
                raise ShardStopped(
                    f"{self.shard.name}: stopped on request with {report.committed} trajectories committed"
                )
        finally:
            # Cancels what is still in flight (after a give-up or an error) before we return.
            await stream.aclose()
            progress.close()
            writer.discard()  # a part still open after an error leaves no file or upload behind

    async def _take(self, record: TrajectoryRecord | SampleFailure | None, progress: tqdm) -> bool:
        """Add what the stream yielded (None: nothing finished a while) and commit when a part is
        due; False once too many samples failed to go on."""
        writer, report = self.writer, self.reporter.report
        if isinstance(record, SampleFailure):
            writer.add_failure(record)
            report.failed = writer.failures_this_attempt()
            if report.failed >= self.give_up_after:
                return False
        elif record is not None:
            writer.add(record)
            self.generated_now += 1
            self.tokens_now += sum(record.response_mask)
            progress.update(1)
            report.generated = self.generated_now
        report.owed = self.owed()
        # In a thread: samples in flight keep talking to the engine while a row group or a part
        # is written (an S3 upload takes tens of milliseconds).
        if writer.row_group_ready():
            await to_thread_to_the_end(writer.write_row_group)
        if writer.should_commit():
            await to_thread_to_the_end(writer.commit)
            report.committed = len(set(self.checkpoint.completed))
        return True

    def check_failures(self) -> None:
        """After the stream has pulled every row (or gave up), the filter has decided them all: too
        many failed samples fail the shard (TooManyFailedSamples)."""
        owed, failed = self.owed(), len(self.checkpoint.failed)
        allowed = allowed_failures(owed, self.gen.max_failed_fraction)
        if failed > allowed:
            raise TooManyFailedSamples(
                f"{self.shard.name}: {failed} of {owed} trajectories failed, more than "
                f"generation.max_failed_fraction={self.gen.max_failed_fraction} allows "
                f"({allowed}); errors in {self.folder.display(shard_file(self.shard.name, FAILURES_DIR))}/. "
                "The next attempt regenerates only the failed and missing samples"
            )

    def record_error(self, exc: BaseException) -> None:
        """The attempt's error, written beside its shard for `genrun status` and the next attempt."""
        checkpoint = self.checkpoint
        try:
            write_last_error(
                self.folder,
                self.shard.name,
                {
                    "attempt": checkpoint.attempts,
                    "error": f"{type(exc).__name__}: {exc}",
                    "committed": len(checkpoint.completed),
                    "time": time.time(),
                },
            )
        except Exception as write_error:  # noqa: BLE001 - storage may be what failed (disk full): keep the first error
            logger.warning("%s: could not record the error (%s)", self.shard.name, write_error)

    def success_marker(self) -> SuccessMarker:
        """The shard's success marker, once every trajectory it owes is committed or failed."""
        shard, prompts, checkpoint = self.shard, self.prompts, self.checkpoint
        if prompts.filtered_overlong:
            logger.warning(
                "%s: skipped %d of %d prompts longer than data.max_prompt_length=%d tokens; raise it to keep them",
                shard.name,
                prompts.filtered_overlong,
                prompts.num_rows,
                self.cfg.data.max_prompt_length,
            )
        owed = self.owed()
        missing = owed - len(set(checkpoint.completed)) - len(set(checkpoint.failed))
        if missing:
            raise RuntimeError(
                f"{shard.name}: {missing} trajectories neither committed nor failed after the stream ended"
            )
        stage_seconds = {stage: round(seconds, 3) for stage, seconds in self.writer.stage_seconds.items()}
        stage_seconds["postprocess"] = round(self.worker.postprocess_seconds - self.postprocess_before, 3)
        return SuccessMarker(
            shard=shard.name,
            shard_id=shard.shard_id,
            range=[shard.start, shard.end],
            num_trajectories=len(checkpoint.completed),
            expected_trajectories=owed,
            failures=len(checkpoint.failed),
            failed_samples=list(checkpoint.failed),
            response_tokens=checkpoint.response_tokens,
            generated_tokens=checkpoint.generated_tokens,
            parts=checkpoint.parts,
            repaired_parts=checkpoint.repaired_parts,
            attempts=checkpoint.attempts,
            filtered_overlong=prompts.filtered_overlong,
            not_owed=self.not_owed,
            last_attempt=AttemptStats(
                trajectories=self.generated_now,
                generated_tokens=self.tokens_now,
                seconds=round(time.perf_counter() - self.started, 3),
                stage_seconds=stage_seconds,
                engine={
                    **{name: count - self.engine_before[name] for name, count in self.worker.engine_counters().items()},
                    "peak_calls_in_flight": self.worker.peak_calls_in_flight,
                },
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            ),
        )


async def to_thread_to_the_end(function) -> None:
    """`function` in a thread, awaited to its end even when the awaiting task is cancelled (the
    flow's stop fallback cancels shard jobs): a commit then either completes with its samples or
    never starts, and the `writer.discard()` that follows the cancellation never runs beside
    it. The cancellation is raised once the thread is done."""
    running = asyncio.ensure_future(asyncio.to_thread(function))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        while not running.done():
            try:
                await asyncio.shield(running)
            except asyncio.CancelledError:
                continue  # cancelled again: the thread still has to end first
        if not running.cancelled() and running.exception() is not None:
            logger.warning("a write cancelled with its shard failed: %s", running.exception())
        raise
