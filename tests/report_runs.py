"""Real runs for the report tests: verl's ToolAgentLoop driven by the scripted engine (model
tokens, tool tokens, logprobs, rewards, an engine failure), written through the shard job, the
commit records and the merge exactly as a run writes them, with no Ray."""

from __future__ import annotations

from pathlib import Path

from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.outputs.finish import finish_run
from generation_core.preflight.preflight import RunPlan, preflight
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import committed_parts, read_verified_part
from generation_core.store.trajectory_record import TrajectoryRecord, records_from_parquet
from tests.conftest import REPO, write_parquet
from tests.scripted_engine import ScriptedEngine
from tests.shard_runs import run_shard

TOOLS = REPO / "examples" / "tool_calling" / "tools.yaml"
EXPRESSIONS = {"seven": "3+4", "twelve": "3*4", "nine": "(2+1)**2"}
# (word, data source, ground truth offset): row 4's ground truth is wrong (reward 0), row 5's
# prompt makes the engine fail every time (both its samples are failures).
ROWS = [
    ("seven", "test/arithmetic"),
    ("twelve", "test/arithmetic"),
    ("nine", "test/arithmetic"),
    ("seven", "test/puzzles"),
    ("twelve", "test/puzzles"),
    ("nine", "test/puzzles"),
]
WRONG_ROW, FAILING_ROW = 4, 5
FAILING_TEXT = "carefully"
ROLLOUT_N = 2
COMMITTED = (len(ROWS) - 1) * ROLLOUT_N
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n    return 1.0 if solution_str.strip().endswith(f'{ground_truth}.') else 0.0\n"


def tool_rows() -> list[dict]:
    rows = []
    for index, (word, source) in enumerate(ROWS):
        answer = eval(EXPRESSIONS[word])  # noqa: S307 - the test's own expressions
        text = f"Compute {word} with the calculator{', ' + FAILING_TEXT if index == FAILING_ROW else ''}."
        rows.append(
            {
                "data_source": source,
                "prompt": [{"role": "user", "content": text}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer + 1 if index == WRONG_ROW else answer)},
                "extra_info": {"split": "test", "index": index},
            }
        )
    return rows


def tool_run(directory: Path, model_dir: Path, output: str | None = None) -> RunPlan:
    """A finished 2-shard tool-calling run (merged, manifest.json written) in `output`
    (default: directory/run)."""
    from verl.utils import hf_tokenizer

    data_file = write_parquet(directory / "tools.parquet", tool_rows())
    reward_file = directory / "reward.py"
    reward_file.write_text(REWARD)
    plan = preflight(
        [
            f"data.train_files={data_file}",
            f"trainer.default_local_dir={output or directory / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"data.tool_config_path={TOOLS}",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
            f"reward.custom_reward_function.path={reward_file}",
            "generation.num_shards=2",
            "generation.save_batch_size=2",
            "generation.show_progress=false",
            "generation.request_backoff_seconds=0",
            "generation.max_failed_fraction=0.5",
        ]
    )
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    manifests = []
    for shard in plan.shards:
        prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
        engine = ScriptedEngine(tokenizer, EXPRESSIONS, failures={FAILING_TEXT: None})
        worker = StreamingWorker(plan.cfg, engine, RewardScorer.from_config(plan.cfg, tokenizer))
        try:
            manifests.append(run_shard(plan.cfg, shard, plan.folder, prompts, worker))
        finally:
            worker.shutdown()
    finish_run(plan, manifests, 1.0)
    return plan


def committed_records(folder: StorageFolder) -> list[TrajectoryRecord]:
    """The run's trajectories read straight from its committed parts (the tests' oracle)."""
    records = [r for part in committed_parts(folder) for r in records_from_parquet(read_verified_part(folder, part))]
    return sorted(records, key=lambda r: r.key)
