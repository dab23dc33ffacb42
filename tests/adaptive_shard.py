"""One shard of an adaptive-sampling run with the instant engine, in this process (tests/test_adaptive.py
runs it in a subprocess to kill it with a failpoint, and in the test's process). Usage:
python -m tests.adaptive_shard PROMPTS REWARD OUT_DIR MODEL_DIR"""

from __future__ import annotations

import sys

from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.inputs.shard_rows import DatasetPrompts
from generation_core.preflight.preflight import preflight
from generation_core.shard.rewards import RewardScorer
from generation_core.shard.streaming import StreamingWorker, sample_seed
from tests.shard_runs import run_shard

N, K = 4, 2
SEED = 11


class InjectedFailure(ValueError):
    """An engine error for a chosen sample (a ValueError: not retried, so the sample fails)."""


class FailingEngine:
    """The instant engine, except that the requests of the samples in `failures` (sample key -> how
    many times) raise InjectedFailure; each sample is recognised by its seed (generation.sample_seed)."""

    def __init__(self, engine: InstantEngine, failures: dict[tuple[int, int], int]):
        self.engine, self.remaining = engine, dict(failures)
        self.keys_by_seed = {sample_seed(SEED, key): key for key in failures}

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        key = self.keys_by_seed.get(sampling_params.get("seed"))
        if key is not None and self.remaining[key] > 0:
            self.remaining[key] -= 1
            raise InjectedFailure(f"injected failure of sample {key}")
        return await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def overrides(prompts, reward, out, model_dir, *extra: str) -> list[str]:
    return [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant",
        f"actor_rollout_ref.rollout.n={N}",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "generation.show_progress=false",
        f"generation.sample_seed={SEED}",
        "generation.save_batch_size=4",
        f"reward.custom_reward_function.path={reward}",
        "generation.adaptive=true",
        f"generation.adaptive_k={K}",
        *extra,
    ]


def run_one_shard(prompts, reward, out, model_dir, *extra: str, failures: dict[tuple[int, int], int] | None = None):
    """Run the shard (one attempt) to its success marker; `failures`: samples whose requests fail
    (FailingEngine)."""
    from verl.utils import hf_tokenizer

    plan = preflight(overrides(prompts, reward, out, model_dir, *extra))
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    [shard] = plan.shards
    shard_prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    client = FailingEngine(engine, failures) if failures else engine
    worker = StreamingWorker(plan.cfg, client, RewardScorer.from_config(plan.cfg, tokenizer))
    try:
        return plan, run_shard(plan.cfg, shard, plan.folder, shard_prompts, worker)
    finally:
        worker.shutdown()


if __name__ == "__main__":
    run_one_shard(*sys.argv[1:5])
