"""verl's ToolAgentLoop through configuration, with a deterministic scripted engine: exact
response tokens, mask, logprobs and turn count, then the same through a shard and the merge;
rewards present / absent / raising; engine failures retried, then recorded."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from generation_core.config.loading import load_config
from generation_core.inputs.dataset_files import inspect_dataset
from generation_core.inputs.shard_rows import DatasetPrompts, ShardSpec
from generation_core.outputs.merge import merge_run
from generation_core.shard.attempt import TooManyFailedSamples
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from generation_core.store.commit_log import read_failure_log
from generation_core.store.folder import StorageFolder
from tests import sample_deadline
from tests.conftest import REPO, write_parquet
from tests.scripted_engine import ScriptedEngine
from tests.shard_runs import run_shard

pytestmark = pytest.mark.timeout(240)

TOOLS = REPO / "examples" / "tool_calling" / "tools.yaml"
EXPRESSIONS = {"seven": "3+4", "twelve": "3*4", "nine": "(2+1)**2"}
# The tool turn exactly as the bundled tokenizer's ChatML template renders it after the call.
TOOL_TURN = "<|im_start|>tool\nRESULT<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


def tool_rows(words=("seven", "twelve", "nine")):
    return [
        {
            "data_source": "test/arithmetic",
            "prompt": [{"role": "user", "content": f"Compute {word} with the calculator."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(eval(EXPRESSIONS[word]))},
            "extra_info": {"split": "test", "index": index},
        }
        for index, word in enumerate(words)
    ]


def tool_config(model_dir, *extra, tools=TOOLS):
    cfg = load_config(
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"data.tool_config_path={tools}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "generation.show_progress=false",
            "generation.request_backoff_seconds=0",
            *extra,
        ]
    )
    cfg.actor_rollout_ref.model.path = str(model_dir)
    return cfg


def expected_trajectory(tokenizer, engine, expression):
    call = tokenizer.encode(engine.turn_text("").replace("2+3", expression), add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    tool = tokenizer.encode(TOOL_TURN.replace("RESULT", str(eval(expression))), add_special_tokens=False)
    answer = tokenizer.encode(f"The answer is {eval(expression)}.", add_special_tokens=False) + [tokenizer.eos_token_id]
    return (
        call + tool + answer,
        [1] * len(call) + [0] * len(tool) + [1] * len(answer),
        engine.logprobs(len(call)) + [0.0] * len(tool) + engine.logprobs(len(answer)),
    )


def test_tool_loop_interleaves_model_and_tool_tokens(model_dir, tokenizer):
    cfg = tool_config(model_dir)
    assert cfg.actor_rollout_ref.rollout.agent.default_agent_loop == "tool_agent", (
        "multi_turn.enable selects verl's tool loop"
    )
    engine = ScriptedEngine(tokenizer, EXPRESSIONS)
    worker = StreamingWorker(cfg, engine)
    sample = {
        "raw_prompt": [{"role": "user", "content": "Compute seven with the calculator."}],
        "agent_name": "tool_agent",
        "index": 0,
        "extra_info": {"index": 0},
    }
    record = asyncio.run(worker.run_one((0, 0), sample))

    ids, mask, logprobs = expected_trajectory(tokenizer, engine, "3+4")
    assert record.response_ids == ids
    assert record.response_mask == mask
    assert record.response_logprobs == pytest.approx(logprobs)
    assert record.num_turns == 4, "user + assistant(call) + tool + assistant(answer)"
    assert record.extra_fields["tool_rewards"] == [1.0], "the calculator's reward for a valid expression"
    assert len(engine.calls) == 2
    # The second request is the first prompt + the model's own tokens + the tool turn: no re-encoding.
    assert engine.calls[1] == record.prompt_ids + ids[: mask.index(1, mask.index(0))]


def _run_shard(cfg, tokenizer, data_file, folder, engine, reward=True):
    cfg.data.train_files = str(data_file)
    dataset = inspect_dataset(cfg).files
    shard = ShardSpec(0, 0, dataset.num_rows)
    prompts = DatasetPrompts.for_shard(cfg, dataset, shard, tokenizer)
    scorer = RewardScorer.from_config(cfg, tokenizer) if reward else None
    worker = StreamingWorker(cfg, engine, scorer)
    try:
        return run_shard(cfg, shard, folder, prompts, worker)
    finally:
        worker.shutdown()


def _merge(cfg, folder):
    rollout = cfg.actor_rollout_ref.rollout
    return merge_run(
        folder, prompt_length=rollout.prompt_length, response_length=rollout.response_length, pad_token_id=2
    )


def test_tool_trajectories_through_a_shard_and_the_merge(model_dir, tokenizer, tmp_path):
    cfg = tool_config(model_dir, "actor_rollout_ref.rollout.n=2", "generation.save_batch_size=4")
    data_file = write_parquet(tmp_path / "tools.parquet", tool_rows())
    engine = ScriptedEngine(tokenizer, EXPRESSIONS)
    folder = StorageFolder(str(tmp_path / "run"))
    manifest = _run_shard(cfg, tokenizer, data_file, folder, engine, reward=False)
    assert manifest.num_trajectories == 6 and manifest.failures == 0

    data = _merge(cfg, folder)
    assert data.non_tensor_batch["index"].tolist() == [0, 0, 1, 1, 2, 2], (
        "interleaved like verl's repeat(interleave=True)"
    )
    assert "rm_scores" not in data.batch.keys(), "no reward function, no rm_scores"
    for row, expression in enumerate(["3+4", "3+4", "3*4", "3*4", "(2+1)**2", "(2+1)**2"]):
        ids, mask, logprobs = expected_trajectory(tokenizer, engine, expression)
        width = len(ids)
        assert data.batch["responses"][row, :width].tolist() == ids
        assert data.batch["responses"][row, width:].eq(2).all(), "right-padded with pad id"
        assert data.batch["response_mask"][row, :width].tolist() == mask
        assert data.batch["response_mask"][row, width:].eq(0).all()
        assert torch.allclose(data.batch["rollout_log_probs"][row, :width], torch.tensor(logprobs))
        assert data.batch["rollout_log_probs"][row][data.batch["response_mask"][row] == 0].eq(0).all(), (
            "logprob 0 on tool tokens"
        )
    assert data.non_tensor_batch["__num_turns__"].tolist() == [4] * 6
    assert [list(v) for v in data.non_tensor_batch["tool_rewards"]] == [[1.0]] * 6


def test_reward_function_fills_rm_scores_at_the_last_response_token(model_dir, tokenizer, tmp_path):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    right = solution_str.strip().endswith(f'{ground_truth}.')\n"
        "    return {'score': 1.0 if right else 0.25, 'turns': extra_info['num_turns']}\n"
    )
    cfg = tool_config(model_dir, f"reward.custom_reward_function.path={reward_file}")
    # The scripted answers are right; make the ground truth of sample 1 wrong.
    rows = tool_rows()
    rows[1]["reward_model"]["ground_truth"] = "13"
    data_file = write_parquet(tmp_path / "tools.parquet", rows)
    folder = StorageFolder(str(tmp_path / "run"))
    _run_shard(cfg, tokenizer, data_file, folder, ScriptedEngine(tokenizer, EXPRESSIONS))
    data = _merge(cfg, folder)
    rm_scores = data.batch["rm_scores"]
    last = data.batch["attention_mask"][:, cfg.actor_rollout_ref.rollout.prompt_length :].sum(dim=1) - 1
    assert rm_scores[torch.arange(3), last].tolist() == [1.0, 0.25, 1.0]
    assert rm_scores.sum().item() == pytest.approx(2.25), "nothing but the last token carries the score"
    assert data.non_tensor_batch["turns"].tolist() == [4, 4, 4], "the reward dict's other keys become columns"
    assert data.meta_info["reward_extra_keys"] == ["score", "turns"]


def test_a_raising_reward_function_is_a_recorded_sample_failure(model_dir, tokenizer, tmp_path):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    if ground_truth == '12':\n"
        "        raise ZeroDivisionError('scorer bug')\n"
        "    return 1.0\n"
    )
    cfg = tool_config(
        model_dir, f"reward.custom_reward_function.path={reward_file}", "generation.max_failed_fraction=0.5"
    )
    data_file = write_parquet(tmp_path / "tools.parquet", tool_rows())
    folder = StorageFolder(str(tmp_path / "run"))
    manifest = _run_shard(cfg, tokenizer, data_file, folder, ScriptedEngine(tokenizer, EXPRESSIONS))
    assert manifest.num_trajectories == 2 and manifest.failed_samples == ["1:0"]
    [failure] = read_failure_log(folder, "shard-00000")
    assert "RewardFunctionError: reward function raised ZeroDivisionError: scorer bug" in failure["error"]
    data = _merge(cfg, folder)
    assert data.non_tensor_batch["index"].tolist() == [0, 2]
    assert np.allclose(data.batch["rm_scores"].sum(dim=1).numpy(), [1.0, 1.0])


def test_engine_failures_are_retried_then_recorded(model_dir, tokenizer, tmp_path):
    cfg = tool_config(model_dir, "generation.request_retries=2", "generation.max_failed_fraction=0.5")
    data_file = write_parquet(tmp_path / "tools.parquet", tool_rows())
    # "seven" fails twice (recovered by 2 retries); "twelve" always fails (recorded).
    engine = ScriptedEngine(tokenizer, EXPRESSIONS, failures={"seven": 2, "twelve": None})
    folder = StorageFolder(str(tmp_path / "run"))
    manifest = _run_shard(cfg, tokenizer, data_file, folder, engine, reward=False)
    assert manifest.num_trajectories == 2 and manifest.failed_samples == ["1:0"]
    assert engine.failed_calls == 2 + 3, "seven: 2 failures then success; twelve: 1 try + 2 retries"
    [failure] = read_failure_log(folder, "shard-00000")
    assert failure["error"] == "EngineCrashed: injected engine failure for a prompt with 'twelve'"

    # max_failed_fraction=0: the same failure fails the shard; a later attempt with a healthy
    # engine regenerates only the failed sample.
    strict = tool_config(model_dir, "generation.request_retries=1")
    other = StorageFolder(str(tmp_path / "strict"))
    with pytest.raises(TooManyFailedSamples, match="1 of 3 trajectories failed"):
        _run_shard(
            strict,
            tokenizer,
            data_file,
            other,
            ScriptedEngine(tokenizer, EXPRESSIONS, failures={"twelve": None}),
            reward=False,
        )
    healthy = ScriptedEngine(tokenizer, EXPRESSIONS)
    manifest = _run_shard(strict, tokenizer, data_file, other, healthy, reward=False)
    assert manifest.num_trajectories == 3 and manifest.failures == 0
    assert len(healthy.calls) == 2 and all("twelve" in tokenizer.decode(call) for call in healthy.calls)


# --- a sample that never finishes: generation.sample_timeout_seconds (issue 31, item 9) ----------

HANGING_REWARDS = {
    "async-sleeps-forever": (
        "import asyncio\n\n"
        "async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    if ground_truth == '12':\n"
        "        await asyncio.Event().wait()\n"
        "    return 1.0\n"
    ),
    "sync-never-returns": (
        "from tests.sample_deadline import RELEASE\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
        "    if ground_truth == '12':\n"
        "        RELEASE.wait()\n"
        "    return 1.0\n"
    ),
}
# Short, and yet long enough for the healthy samples (milliseconds each) on a loaded machine.
DEADLINE = ["generation.sample_timeout_seconds=3", "generation.max_failed_fraction=0.5"]
# One sample at a time: the samples after the hung one run only if its deadline frees its slot.
ONE_AT_A_TIME = "generation.max_inflight=1"


@pytest.fixture
def hang_until_the_end():
    """Threads that wait for RELEASE are let go at the end of the test, or after 60 s: without a
    deadline asyncio.run would join such a thread for ever, past pytest-timeout."""
    sample_deadline.RELEASE.clear()
    backstop = threading.Timer(60, sample_deadline.RELEASE.set)
    backstop.daemon = True
    backstop.start()
    yield
    backstop.cancel()
    sample_deadline.RELEASE.set()


def _the_deadline_failed_sample_1(manifest, folder_path, where: str) -> None:
    assert manifest.num_trajectories == 2 and manifest.failed_samples == ["1:0"], (
        "the other samples commit, the shard finishes"
    )
    [failure] = sample_deadline.failure_log(folder_path / "shards" / "shard-00000")
    assert failure["error"].startswith(
        "SampleTimedOut: sample 1:0 did not finish within generation.sample_timeout_seconds=3 s"
    ), failure["error"]
    assert where in failure["traceback"], "the failure shows where the sample was waiting"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reward", list(HANGING_REWARDS))
def test_a_reward_function_that_never_returns_fails_its_sample_at_the_deadline(
    model_dir, tokenizer, tmp_path, hang_until_the_end, reward
):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(HANGING_REWARDS[reward])
    cfg = tool_config(model_dir, f"reward.custom_reward_function.path={reward_file}", *DEADLINE, ONE_AT_A_TIME)
    data_file = write_parquet(tmp_path / "tools.parquet", tool_rows())
    manifest = _run_shard(
        cfg, tokenizer, data_file, StorageFolder(str(tmp_path / "run")), ScriptedEngine(tokenizer, EXPRESSIONS)
    )
    _the_deadline_failed_sample_1(manifest, tmp_path / "run", "in score")


@pytest.mark.timeout(120)
def test_a_tool_hung_in_a_thread_fails_its_sample_and_the_shard_finishes(
    model_dir, tokenizer, tmp_path, hang_until_the_end
):
    """The tool's thread never returns: its sample fails at the deadline, the event loop goes on
    with the others, and the shard's asyncio.run returns without waiting for that thread."""
    tools = tmp_path / "tools.yaml"
    tools.write_text(
        "tools:\n  - class_name: tests.sample_deadline.CalculatorThatHangsInAThread\n    config:\n      type: native\n"
    )
    cfg = tool_config(model_dir, *DEADLINE, ONE_AT_A_TIME, tools=tools)
    data_file = write_parquet(tmp_path / "tools.parquet", tool_rows())
    manifest = _run_shard(
        cfg,
        tokenizer,
        data_file,
        StorageFolder(str(tmp_path / "run")),
        ScriptedEngine(tokenizer, EXPRESSIONS),
        reward=False,
    )
    _the_deadline_failed_sample_1(manifest, tmp_path / "run", "tool_agent_loop.py")
    assert not sample_deadline.RELEASE.is_set(), "the tool's thread was still waiting when the shard finished"


class KeyRecordingEngine(ScriptedEngine):
    """The scripted engine, noting the request id and trajectory key of each turn it serves."""

    def __init__(self, tokenizer, expressions):
        super().__init__(tokenizer, expressions)
        self.turns: list[tuple[str, str | None]] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, trajectory_key=None, **unused):
        self.turns.append((request_id, trajectory_key))
        return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **unused)


class _InProcessEngineHandle:
    """An EngineServer actor's handle, in this process: `serve_batch` streams its answers as Ray's
    streaming call would (an awaitable per yield)."""

    def __init__(self, engine):
        from generation_core.engines.server import EngineServer

        self.server = EngineServer(lambda: engine)
        self.serve_batch = self

    def options(self, **_):
        return self

    async def remote(self, requests):
        async for answers in self.server.serve_batch(requests):
            ready = asyncio.get_running_loop().create_future()
            ready.set_result(answers)
            yield ready


class _OneBackend:
    def __init__(self, backend):
        self.backend = backend

    async def connect(self, wait_seconds: float = 0.0):
        return {"r0": self.backend}, {}

    async def aclose(self) -> None:
        pass


def test_our_engine_sees_one_trajectory_key_across_the_turns_of_a_tool_trajectory(model_dir, tokenizer):
    """What the hf engine's later_turns_first recognises a later turn by (engines/hf/admission.py):
    through the routing client and a replica backend, each turn goes with a fresh request id (as
    verl's client sends it) and the agent loop's own id as `trajectory_key`."""
    from generation_core.engines.hf.admission import RequestIds
    from generation_core.serving.backends import RayReplicaBackend
    from generation_core.serving.routing import RoutingClient

    cfg = tool_config(model_dir)
    engine = KeyRecordingEngine(tokenizer, EXPRESSIONS)
    client = RoutingClient(cfg, _OneBackend(RayReplicaBackend(_InProcessEngineHandle(engine), cfg)))
    worker = StreamingWorker(cfg, client)
    samples = [
        {
            "raw_prompt": [{"role": "user", "content": f"Compute {word} with the calculator."}],
            "agent_name": "tool_agent",
            "index": i,
            "extra_info": {"index": i},
        }
        for i, word in enumerate(("seven", "twelve"))
    ]

    async def both():
        return await asyncio.gather(*(worker.run_one((i, 0), sample) for i, sample in enumerate(samples)))

    records = asyncio.run(both())
    assert [r.num_turns for r in records] == [4, 4]
    assert len(engine.turns) == 4
    request_ids = [request_id for request_id, _ in engine.turns]
    keys = [key for _, key in engine.turns]
    assert len(set(request_ids)) == 4, "a fresh request id per turn (verl's servers need unique ids)"
    assert None not in keys and len(set(keys)) == 2 and sorted(keys.count(k) for k in set(keys)) == [2, 2]
    admission = RequestIds()
    assert [admission.seen_before(key) for key in keys].count(True) == 2, (
        "each trajectory's second turn is a later turn"
    )
