"""Adaptive sampling against plain n-sampling (issue 36, item 6): tokens spent, and how well the
kept prompt set (pass rate strictly between 0 and 1) agrees with the one full n gives.

    PYTHONPATH=. .venv/bin/python bench/adaptive_sampling.py [--prompts 200] [--n 16] [--k 4 8]

Synthetic and exact: the instant engine (no model), one shard in this process, `sample_seed` so
that every sample's response is fixed by (index, rollout_n), and a reward file whose score is 1
when a hash of the response falls below the prompt's known pass rate (its ground_truth). The
prompts' pass rates: 35% never solved (0), 35% always (1), 30% uniform in [0.2, 0.8]. Because a
sample's response and reward do not depend on the run, an adaptive run's samples are a subset of
the plain run's: the kept sets are compared prompt by prompt, side by side in one process.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from contextlib import asynccontextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REWARD = """
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    draw = int.from_bytes(hashlib.sha256(solution_str.encode()).digest()[:8], "big") / 2**64
    return float(draw < float(ground_truth))
"""


def write_inputs(folder: Path, prompts: int) -> tuple[Path, Path]:
    draw = random.Random(0)
    rates = [
        0.0 if u < 0.35 else 1.0 if u < 0.70 else draw.uniform(0.2, 0.8)
        for u in (draw.random() for _ in range(prompts))
    ]
    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": f"Problem {i}: what is {i} * 7?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": repr(rate)},
            "extra_info": {"index": i},
        }
        for i, rate in enumerate(rates)
    ]
    pq.write_table(pa.Table.from_pylist(rows), folder / "prompts.parquet")
    (folder / "reward.py").write_text(REWARD)
    return folder / "prompts.parquet", folder / "reward.py"


class InstantWorkers:
    """The shard job's worker factory (shard/protocols.py): the shard's rows, and a worker on an
    instant engine in this process with the run's reward function."""

    def prompts(self, plan, shard):
        from generation_core.shard.job import dataset_prompts

        return dataset_prompts(plan, shard)

    @asynccontextmanager
    async def worker(self, plan, shard):
        from generation_core.engines.instant import InstantEngine, InstantSettings
        from generation_core.inputs.tokenizer import run_tokenizer
        from generation_core.shard.rewards import RewardScorer
        from generation_core.shard.streaming import StreamingWorker

        tokenizer = run_tokenizer(plan.cfg.actor_rollout_ref.model)
        engine = InstantEngine(
            InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id)
        )
        worker = StreamingWorker(plan.cfg, engine, RewardScorer.from_config(plan.cfg, tokenizer))
        try:
            yield worker
        finally:
            worker.shutdown()


def run(folder: Path, prompts: Path, reward: Path, n: int, k: int | None):
    """(committed rewards by prompt, response tokens committed) of one single-shard run."""
    from generation_core.config.bundled import prepare_bundled_model
    from generation_core.exports.rl_prompts import prompt_rewards
    from generation_core.preflight.preflight import preflight
    from generation_core.shard.job import run_shard_job
    from generation_core.store.part_repair import committed_parts

    model = prepare_bundled_model()
    adaptive = ["generation.adaptive=true", f"generation.adaptive_k={k}"] if k else []
    plan = preflight(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={folder}",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.rollout.name=instant",
            f"actor_rollout_ref.rollout.n={n}",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "generation.show_progress=false",
            "generation.sample_seed=3",
            f"reward.custom_reward_function.path={reward}",
            *adaptive,
        ]
    )
    plan.claim_folder()
    [shard] = plan.shards
    marker = run_shard_job(plan, shard, worker_factory=InstantWorkers())
    rewards = {index: p.rewards for index, p in prompt_rewards(plan.folder, committed_parts(plan.folder)).items()}
    return rewards, marker.response_tokens


def kept(rewards: dict[int, list]) -> set[int]:
    return {index for index, r in rewards.items() if 0 < sum(x > 0 for x in r) < len(r)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch)
        prompts, reward = write_inputs(base, args.prompts)
        full, full_tokens = run(base / "plain", prompts, reward, args.n, None)
        reference = kept(full)
        print(
            f"{args.prompts} prompts, n={args.n}: plain n-sampling {full_tokens} response tokens, {len(reference)} prompts kept (0 < pass rate < 1)"
        )
        print("| k | tokens | tokens / plain | fewer tokens | kept | precision | recall |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for k in args.k:
            rewards, tokens = run(base / f"adaptive-{k}", prompts, reward, args.n, k)
            chosen = kept(rewards)
            precision = len(chosen & reference) / len(chosen) if chosen else 1.0
            recall = len(chosen & reference) / len(reference) if reference else 1.0
            print(
                f"| {k} | {tokens} | {tokens / full_tokens:.3f} | {1 - tokens / full_tokens:.1%} | {len(chosen)} | {precision:.3f} | {recall:.3f} |"
            )


if __name__ == "__main__":
    main()
