"""Model-call slots (generation_core/shard/call_slots.py): `generation.max_inflight` bounds model
calls in flight, not trajectories; a freed slot goes to a started trajectory's next turn before a
new prompt; a tool run through a shard still commits every trajectory exactly once."""

from __future__ import annotations

import asyncio

import pytest

from generation_core.config.loading import load_config
from generation_core.config.settings import GenerationSettings
from generation_core.inputs.dataset_files import inspect_dataset
from generation_core.inputs.shard_rows import DatasetPrompts, ShardSpec
from generation_core.outputs.merge import merge_run
from generation_core.shard.call_slots import CallSlots, SlottedClient, sample_context
from generation_core.shard.streaming import StreamingWorker
from generation_core.store.folder import StorageFolder
from tests.conftest import write_parquet
from tests.run_folder_helpers import committed_keys
from tests.scripted_engine import ScriptedEngine
from tests.shard_runs import run_shard
from tests.slow_tools import SlowCalculatorTool

pytestmark = pytest.mark.timeout(180)

SLOW_TOOLS = """
tools:
  - class_name: tests.slow_tools.SlowCalculatorTool
    config: {type: native}
"""


def test_a_freed_slot_goes_to_later_turns_first_then_first_turns_in_arrival_order():
    async def scenario():
        slots = CallSlots(1)
        order: list[str] = []

        async def call(name: str, later_turn: bool) -> None:
            await slots.acquire(later_turn)
            order.append(name)

        await slots.acquire(False)  # the only slot is taken while the others queue
        waiters = [
            asyncio.ensure_future(call("new prompt 1", False)),
            asyncio.ensure_future(call("new prompt 2", False)),
        ]
        await asyncio.sleep(0)
        # A started trajectory back from its tool, after both new prompts queued.
        waiters.append(asyncio.ensure_future(call("later turn", True)))
        await asyncio.sleep(0)
        assert slots.waiting == 3 and slots.spare == -3
        for _ in waiters:
            slots.release()
            await asyncio.sleep(0)
        await asyncio.gather(*waiters)
        return order, slots

    order, slots = asyncio.run(scenario())
    assert order == ["later turn", "new prompt 1", "new prompt 2"]
    assert slots.in_flight == 1 and slots.waiting == 0 and slots.peak_in_flight == 1


def test_a_samples_second_call_is_a_later_turn_and_a_started_sample_counts_against_spare():
    async def scenario():
        slots = CallSlots(2)
        slots.sample_started((0, 0))
        spare_before_its_call = slots.spare
        with sample_context((0, 0)):
            turns = [slots.is_later_turn(), slots.is_later_turn()]
        # Outside any sample (a library caller's own call): a first turn.
        return spare_before_its_call, turns, slots.is_later_turn()

    assert asyncio.run(scenario()) == (1, [False, True], False)


def test_a_cancelled_waiter_leaves_no_slot_behind():
    async def scenario():
        slots = CallSlots(1)
        await slots.acquire(False)
        cancelled = asyncio.ensure_future(slots.acquire(False))
        await asyncio.sleep(0)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert slots.waiting == 0
        # Handed the slot and cancelled before it ran: the slot passes on to the next waiter.
        handed = asyncio.ensure_future(slots.acquire(False))
        after = asyncio.ensure_future(slots.acquire(True))
        await asyncio.sleep(0)
        slots.release()
        handed.cancel()
        await asyncio.gather(handed, return_exceptions=True)
        await asyncio.sleep(0)
        return slots, after

    slots, after = asyncio.run(scenario())
    assert after.done() and not after.cancelled()
    assert slots.in_flight == 1 and slots.waiting == 0


class CountingEngine(ScriptedEngine):
    """The scripted tool-calling engine with a per-call latency; counts calls running at once."""

    def __init__(self, tokenizer, seconds: float):
        super().__init__(tokenizer)
        self.seconds = seconds
        self.running = 0
        self.peak_running = 0

    async def generate(self, request_id, **kwargs):
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            await asyncio.sleep(self.seconds)
            return await super().generate(request_id, **kwargs)
        finally:
            self.running -= 1


def slow_tool_config(model_dir, tmp_path, *extra):
    tools = tmp_path / "slow_tools.yaml"
    tools.write_text(SLOW_TOOLS)
    cfg = load_config(
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"data.tool_config_path={tools}",
            "generation.show_progress=false",
            "generation.request_backoff_seconds=0",
            "generation.first_part_max_seconds=null",
            *extra,
        ]
    )
    cfg.actor_rollout_ref.model.path = str(model_dir)
    return cfg


def test_a_tool_run_bounds_model_calls_not_trajectories_and_commits_each_once(model_dir, tmp_path):
    from verl.utils import hf_tokenizer

    tokenizer = hf_tokenizer(str(model_dir))
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i}+{i} with the calculator."}],
            "data_source": "t",
            "extra_info": {"index": i},
        }
        for i in range(24)
    ]
    cfg = slow_tool_config(
        model_dir,
        tmp_path,
        f"data.train_files={write_parquet(tmp_path / 'rows.parquet', rows)}",
        "actor_rollout_ref.rollout.n=2",
        "generation.max_inflight=4",
    )
    assert GenerationSettings.of(cfg).open_trajectories_limit == 32
    folder = StorageFolder(str(tmp_path / "run"))
    dataset = inspect_dataset(cfg).files
    shard = ShardSpec(0, 0, dataset.num_rows)
    prompts = DatasetPrompts.for_shard(cfg, dataset, shard, tokenizer)
    # Model calls and tool calls of about the same length: half a trajectory's life is in its tool.
    engine = CountingEngine(tokenizer, seconds=0.02)
    worker = StreamingWorker(cfg, engine)
    open_now = open_peak = 0
    original = worker.samples.run_one

    async def counting_run_one(key, kwargs):
        nonlocal open_now, open_peak
        open_now += 1
        open_peak = max(open_peak, open_now)
        try:
            return await original(key, kwargs)
        finally:
            open_now -= 1

    worker.samples.run_one = counting_run_one  # every sample of the worker's stream runs through it
    SlowCalculatorTool.peak_running = 0
    try:
        run_shard(cfg, shard, folder, prompts, worker)
    finally:
        worker.shutdown()

    assert engine.peak_running == 4, (
        "never more model calls in flight than generation.max_inflight, and the bound is reached"
    )
    assert open_peak > 4 and SlowCalculatorTool.peak_running > 0, (
        "trajectories in their tool calls beyond the model-call slots"
    )
    assert len(engine.calls) == 2 * 48, "two model turns (call, answer) per trajectory"
    rollout = cfg.actor_rollout_ref.rollout
    batch = merge_run(
        folder, prompt_length=rollout.prompt_length, response_length=rollout.response_length, pad_token_id=2
    )
    keys = committed_keys(folder)
    assert len(keys) == len(set(keys)) == 48, "every trajectory committed exactly once"
    assert batch.non_tensor_batch["index"].tolist() == [i for i in range(24) for _ in range(2)]
    assert set(batch.non_tensor_batch["__num_turns__"].tolist()) == {4}


def test_slotted_client_passes_calls_through_outside_a_stream():
    class Echo:
        tokenizer = "tok"

        async def generate(self, request_id, **kwargs):
            return request_id

    client = SlottedClient(Echo())
    assert asyncio.run(client.generate("r1", prompt_ids=[1])) == "r1" and client.tokenizer == "tok"


def test_max_open_trajectories_defaults_to_eight_slots_each_and_a_bad_value_is_one_line():
    from generation_core.errors import GenrunError

    settings = GenerationSettings.of(load_config(["actor_rollout_ref.rollout.max_num_seqs=8"]))
    assert (settings.max_inflight, settings.max_open_trajectories) == (16, 128)
    chosen = load_config(["generation.max_inflight=3", "generation.max_open_trajectories=3"])
    assert GenerationSettings.of(chosen).max_open_trajectories == 3
    for bad in ("0", "true", "many"):
        with pytest.raises(GenrunError, match="generation.max_open_trajectories=.*must be null"):
            load_config([f"generation.max_open_trajectories={bad}"])


def test_a_waiter_cancelled_before_a_release_reaches_it_is_skipped():
    async def scenario():
        slots = CallSlots(1)
        await slots.acquire(False)
        cancelled = asyncio.ensure_future(slots.acquire(False))
        waiting = asyncio.ensure_future(slots.acquire(False))
        await asyncio.sleep(0)
        cancelled.cancel()
        slots.release()  # before the cancelled task ran its cleanup: the slot goes to the next one
        outcomes = await asyncio.gather(cancelled, waiting, return_exceptions=True)
        return slots, waiting, outcomes[0]

    slots, waiting, cancelled_outcome = asyncio.run(scenario())
    assert isinstance(cancelled_outcome, asyncio.CancelledError), "its cleanup finds it gone and raises nothing else"
    assert waiting.done() and not waiting.cancelled() and waiting.exception() is None
    assert slots.in_flight == 1 and slots.waiting == 0


def test_a_raised_limit_hands_its_slots_to_waiting_calls_and_a_lowered_one_holds_new_calls_back():
    async def scenario():
        slots = CallSlots(2)
        await slots.acquire(False)
        await slots.acquire(False)
        waiting = [asyncio.ensure_future(slots.acquire(False)) for _ in range(3)]
        await asyncio.sleep(0)
        assert slots.waiting == 3
        slots.set_limit(4)  # the shard's share of the run's budget grew
        await asyncio.sleep(0)
        assert (slots.in_flight, slots.waiting, sum(w.done() for w in waiting)) == (4, 1, 2)
        slots.set_limit(2)  # other shards started again: calls in flight finish, none is cut
        slots.release()
        slots.release()
        await asyncio.sleep(0)
        assert (slots.in_flight, slots.waiting) == (2, 1), "no slot handed out while at or over the lowered limit"
        slots.release()
        await asyncio.sleep(0)
        assert (slots.in_flight, slots.waiting) == (2, 0)
        await asyncio.gather(*waiting)
        return slots

    assert asyncio.run(scenario()).peak_in_flight == 4


def test_a_stream_follows_its_share_of_the_runs_in_flight_budget_and_yields_each_sample_once(model_dir, tmp_path):
    """The stream's model-call limit follows `scale` (the board's share once other shards
    finished, capped by generation.inflight_share_cap): max_inflight 2 until 6 trajectories are
    done, then 3x; every sample still comes out once."""
    from verl.utils import hf_tokenizer

    from generation_core.shard.attempt import pending_samples

    tokenizer = hf_tokenizer(str(model_dir))
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Compute {i}+{i} with the calculator."}],
            "data_source": "t",
            "extra_info": {"index": i},
        }
        for i in range(24)
    ]
    cfg = slow_tool_config(
        model_dir,
        tmp_path,
        f"data.train_files={write_parquet(tmp_path / 'rows.parquet', rows)}",
        "generation.max_inflight=2",
    )
    dataset = inspect_dataset(cfg).files
    prompts = DatasetPrompts.for_shard(cfg, dataset, ShardSpec(0, 0, dataset.num_rows), tokenizer)
    engine = CountingEngine(tokenizer, seconds=0.05)
    worker = StreamingWorker(cfg, engine)
    share, finished, peak_before, open_seen = [1.0], [], 0, []

    async def scenario():
        nonlocal peak_before
        async for record in worker.stream(
            pending_samples(prompts, 1, set()), 2, idle_timeout=0.05, max_open=2, scale=lambda: share[0]
        ):
            open_seen.append((share[0], len(worker.open_samples)))
            if record is None:
                continue
            finished.append((record.index, record.rollout_n))
            if len(finished) == 6:
                peak_before, share[0] = engine.peak_running, 3.0

    try:
        asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert peak_before == 2, "its own max_inflight while its share is 1"
    assert engine.peak_running == 6, "three times as many model calls once its share is 3"
    assert worker.peak_calls_in_flight == 6, "what the success marker reports"
    assert sorted(finished) == [(i, 0) for i in range(24)]
    # What the shard's progress report says is open (the ETA's drain): within each limit, and
    # nothing once the stream is over.
    assert (
        max(count for factor, count in open_seen if factor == 1.0)
        <= 2
        < max(count for factor, count in open_seen if factor == 3.0)
        <= 6
    )
    assert len(worker.open_samples) == 0
