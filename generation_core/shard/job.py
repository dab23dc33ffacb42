"""The shard job: decide whether a shard needs work, and do it. Every dispatcher submits this.

`run_shard_job(plan, shard, ...)` runs in any process of the run's Ray job (a Prefect task on a
Ray worker, or the in-process dispatcher): it decides from the run folder alone whether the shard
has anything left to do (`finished_shard`: a success marker that names the shard's last commit
record, its `done` record; no recorded failures; committed parts intact; its rows unchanged),
attaches to the booted
replica pool, resumes from the checkpoint, streams trajectories into parts and finishes the shard
last (`write_marker`: the done record, created exclusively under the lease, then the marker). It
receives its `ShardSpec` and never plans. `finished_shard` is the only answer to "is this shard
finished?": the flow asks it too (`finished_shards`, for every shard as a run starts) and hands
the answer on to Prefect's cache policy.

A sample whose agent loop still fails after the engine-request retries is never committed: it is
written to the shard's failure log (failures/, with its error) and the shard carries on. Once the
stream ends the shard fails if more than `generation.max_failed_fraction` of its trajectories
failed; otherwise its marker counts the failures. Failed samples are pending for every later
attempt or run, which regenerates exactly them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import time
from collections.abc import Callable, Iterator

import ray
from omegaconf import DictConfig
from tqdm import tqdm
from verl.utils import hf_tokenizer

from generation_core.config.settings import GenerationSettings
from generation_core.inputs.agent_loops import check_agent_loops
from generation_core.inputs.shard_rows import ShardPrompts
from generation_core.instrumentation import mark
from generation_core.run_plan import RunPlan, ShardSpec
from generation_core.serving.pool import attach_client
from generation_core.shard.adaptive import AdaptiveRule, decided_prompts
from generation_core.shard.finished import finished_shard, rows_digest_reader
from generation_core.shard.part_writer import PartWriter
from generation_core.shard.progress import ShardReporter, ShardStopped
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from generation_core.store.commit_log import ShardCheckpoint, write_marker
from generation_core.store.folder import StorageFolder
from generation_core.store.lease import LeaseFence, LeaseLost
from generation_core.store.run_folder import FAILURES_DIR, AttemptStats, SuccessMarker, shard_file, write_last_error
from generation_core.store.trajectory_record import SampleFailure, sample_key_text

logger = logging.getLogger(__name__)

# How long a shard job waits for the driver to boot the replicas (SGLang on a large model takes
# minutes); the driver cancels its shard jobs at once when the boot fails.
POOL_BOOT_WAIT_SECONDS = 1800.0
# With a progress board, the longest a shard job takes to see a stop request while it waits
# for trajectories.
STOP_CHECK_SECONDS = 1.0


class TooManyFailedSamples(RuntimeError):
    """More samples of a shard failed than generation.max_failed_fraction allows."""


def run_shard_job(
    plan: RunPlan,
    shard: ShardSpec,
    *,
    registry_name: str,
    lease_generation: int | None = None,
    progress_board: str | None = None,
    rows_checked: bool = False,
) -> SuccessMarker:
    """Run one shard if it needs work. `lease_generation`: the run's lease on the folder (commits
    stop if a later run takes it). `progress_board`: the run's ProgressBoard actor, which gets
    this job's counters and may ask it to stop (ShardStopped, after committing what finished).
    `rows_checked`: the flow found this shard finished as the run started and checked its rows
    then (`finished_shards`); a job run because Prefect had no cached result does not read them
    again."""
    folder = plan.folder
    fence = LeaseFence(lease_generation) if lease_generation is not None else None
    rows_digest_now = None if rows_checked else rows_digest_reader(plan, shard)
    finished = finished_shard(folder, shard, rows_digest_now=rows_digest_now, fence=fence)
    if finished is not None:
        return finished.as_skipped()
    reporter = ShardReporter.attach(progress_board, shard.shard_id)
    if reporter.stop_requested_now():
        raise ShardStopped(f"{shard.name}: the run is stopping; not started")
    cfg = plan.cfg
    tokenizer = _tokenizer(
        os.path.expanduser(cfg.actor_rollout_ref.model.path), cfg.actor_rollout_ref.model.trust_remote_code
    )
    # Only this shard's rows, read and filtered here (never the whole dataset).
    prompts = ShardPrompts.for_shard(cfg, plan.dataset, shard, tokenizer)
    client = attach_client(cfg, registry_name)
    worker = build_streaming_worker(cfg, client, prompts)
    worker.provenance["model_digest"] = plan.model_digest
    mark(f"shard_worker_ready {shard.shard_id}")

    async def when_the_pool_is_up() -> SuccessMarker:
        # The driver may still be loading the model: shard jobs start beside it.
        await client.connect(wait_seconds=POOL_BOOT_WAIT_SECONDS)
        try:
            return await generate_shard(cfg, shard, folder, prompts, worker, fence, reporter)
        finally:
            await client.aclose()

    try:
        manifest = asyncio.run(when_the_pool_is_up())
    finally:
        worker.shutdown()
    manifest.last_attempt.worker = _where_this_runs()
    write_marker(folder, manifest, fence)
    mark(f"shard_done {shard.shard_id}")
    return manifest


@functools.lru_cache(maxsize=2)
def _tokenizer(model_path: str, trust_remote_code: bool):
    """verl's tokenizer loader, once per process: a Ray worker runs many shards (~0.5 s each)."""
    return hf_tokenizer(model_path, trust_remote_code=trust_remote_code)


def build_streaming_worker(cfg: DictConfig, llm_client, prompts: ShardPrompts) -> StreamingWorker:
    """A streaming worker for this process, with the run's reward function. The agent-loop check
    is the preflight's again: this process (a Ray worker) loads plugins and YAML itself."""
    check_agent_loops(cfg, prompts.agent_names())
    return StreamingWorker(cfg, llm_client, RewardScorer.from_config(cfg, prompts.tokenizer))


def _where_this_runs() -> dict:
    """The Ray node and the GPUs this shard job held (none: the replicas own the GPUs)."""
    if not ray.is_initialized():
        return {"node_id": None, "pid": os.getpid(), "gpu_ids": []}
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "pid": os.getpid(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}


async def run_shard_with_worker(
    cfg: DictConfig,
    shard: ShardSpec,
    folder: StorageFolder,
    prompts,
    worker: StreamingWorker,
    fence: LeaseFence | None = None,
) -> SuccessMarker:
    """`run_shard_job` for a caller that brings its own worker (library use, tests): the same
    decision, then the same generation, then the marker; a finished shard's rows are checked
    against its recorded digest with the digest `prompts` carries (none: not checked)."""
    rows_digest_now = (
        (lambda: getattr(prompts, "rows_digest", None)) if GenerationSettings.of(cfg).recheck_finished_rows else None
    )
    finished = finished_shard(folder, shard, rows_digest_now=rows_digest_now, fence=fence)
    if finished is not None:
        return finished.as_skipped()
    manifest = await generate_shard(cfg, shard, folder, prompts, worker, fence)
    write_marker(folder, manifest, fence)
    return manifest


def pending_samples(
    prompts, n: int, done: set[str], rollouts: Callable[[int], range] | None = None
) -> Iterator[tuple[tuple[int, int], dict]]:
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
    cfg: DictConfig,
    shard: ShardSpec,
    folder: StorageFolder,
    prompts,
    worker: StreamingWorker,
    fence: LeaseFence | None,
    reporter: ShardReporter | None = None,
) -> SuccessMarker:
    """Generate every trajectory of `shard` its checkpoint lacks; returns the manifest (the
    caller writes it as the success marker). With a `reporter` attached to the run's progress
    board: counters go there, and a stop request commits what has finished and raises
    ShardStopped."""
    generation = ShardGeneration(cfg, shard, folder, prompts, worker, fence, reporter)
    try:
        await generation.stream_and_commit()
        await generation.second_round()
        generation.check_failures()
    except (LeaseLost, ShardStopped):
        raise  # another run holds the folder now, or this run is stopping: no error to record
    except Exception as exc:
        generation.record_error(exc)
        raise
    return generation.success_marker()


class ShardGeneration:
    """One attempt at a shard: its commit record started, the stream of its pending samples, the
    part writer that commits them, and the counters its success marker reports."""

    def __init__(
        self,
        cfg: DictConfig,
        shard: ShardSpec,
        folder: StorageFolder,
        prompts,
        worker: StreamingWorker,
        fence: LeaseFence | None,
        reporter: ShardReporter | None,
    ):
        self.cfg, self.shard, self.folder, self.prompts, self.worker = cfg, shard, folder, prompts, worker
        self.gen = gen = GenerationSettings.of(cfg)
        self.reporter = reporter if reporter is not None else ShardReporter(None, shard.shard_id)
        # The attempt's commit record (under a lease, the run's claim on the shard), with the digest
        # of the shard's rows (library callers' prompts may carry none); failed samples of earlier
        # attempts are pending again.
        self.checkpoint = ShardCheckpoint.start_attempt(
            folder, shard.name, fence, rows_digest=getattr(prompts, "rows_digest", None)
        )
        self.done = set(self.checkpoint.completed)
        # Every trajectory of this attempt names it (a library caller's worker may keep none).
        if isinstance(getattr(worker, "provenance", None), dict):
            worker.provenance["attempt"] = self.checkpoint.attempts
        self.n = cfg.actor_rollout_ref.rollout.n
        self.adaptive = AdaptiveRule.of(cfg)
        self.rollouts = self.adaptive.first_round if self.adaptive else None
        self.not_owed = 0
        """Samples the adaptive rule decided not to draw (known once round 1 is committed)."""
        logger.info("%s: %d rows, %d trajectories committed", shard.name, prompts.num_rows, len(self.done))
        self.started = time.perf_counter()
        self.postprocess_before = worker.postprocess_seconds
        self.engine_before = engine_counters(worker)
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
                    if isinstance(record, SampleFailure):
                        writer.add_failure(record)
                        report.failed = writer.failures_this_attempt()
                        if report.failed >= self.give_up_after:
                            break
                    elif record is not None:
                        writer.add(record)
                        self.generated_now += 1
                        self.tokens_now += sum(record.response_mask)
                        progress.update(1)
                        report.generated = self.generated_now
                    report.owed = self.owed()
                    # In a thread: samples in flight keep talking to the engine while a row group or a
                    # part is written (an S3 upload takes tens of milliseconds).
                    if writer.row_group_ready():
                        await to_thread_to_the_end(writer.write_row_group)
                    if writer.should_commit():
                        await to_thread_to_the_end(writer.commit)
                        report.committed = len(set(self.checkpoint.completed))
                    if reporter.stop:
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
                    **{name: count - self.engine_before[name] for name, count in engine_counters(self.worker).items()},
                    "peak_calls_in_flight": getattr(self.worker, "peak_calls_in_flight", 0),
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


def engine_counters(worker: StreamingWorker) -> dict[str, int]:
    """Counters of the worker's engine client (RetryingClient around the routing client)."""
    client = getattr(worker, "client", None)
    stats = getattr(client, "stats", None)
    return {
        "requests": getattr(stats, "requests", 0),
        "request_retries": getattr(stats, "retries", 0),
        "replica_failures": getattr(getattr(client, "client", None), "replica_failures", 0),
    }
