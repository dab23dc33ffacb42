"""One shard of an adaptive-sampling run with the instant engine, in this process (tests/test_adaptive.py
runs it in a subprocess to kill it with a failpoint, and in the test's process). Usage:
python -m tests.adaptive_shard PROMPTS REWARD OUT_DIR MODEL_DIR"""

from __future__ import annotations

import asyncio
import sys

from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.inputs.shard_rows import ShardPrompts
from generation_core.plan.preflight import preflight
from generation_core.shard.job import run_shard_with_worker
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker

N, K = 4, 2


def overrides(prompts, reward, out, model_dir, *extra: str) -> list[str]:
    return [
        f"data.train_files={prompts}", f"trainer.default_local_dir={out}", f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant", f"actor_rollout_ref.rollout.n={N}", "data.max_prompt_length=64", "data.max_response_length=16",
        "generation.show_progress=false", "generation.sample_seed=11", "generation.save_batch_size=4", f"reward.custom_reward_function.path={reward}",
        "generation.adaptive=true", f"generation.adaptive_k={K}", *extra,
    ]


def run_one_shard(prompts, reward, out, model_dir, *extra: str):
    from verl.utils import hf_tokenizer

    plan = preflight(overrides(prompts, reward, out, model_dir, *extra))
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    [shard] = plan.shards
    shard_prompts = ShardPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    worker = StreamingWorker(plan.cfg, engine, RewardScorer.from_config(plan.cfg, tokenizer))
    try:
        return plan, asyncio.run(run_shard_with_worker(plan.cfg, shard, plan.folder, shard_prompts, worker))
    finally:
        worker.shutdown()


if __name__ == "__main__":
    run_one_shard(*sys.argv[1:5])
