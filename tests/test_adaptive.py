"""Adaptive sampling (issue 36, item 6): each prompt's first k samples, the rest only where they
disagree; a decided prompt keeps k samples and its shard does not owe the others. A shard killed
with kill -9 in its first round and resumed commits exactly the samples an uninterrupted one does
(the decision reads committed rewards only), and the merge accepts the counts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from generation_core.errors import GenrunError
from generation_core.outputs.merge import check_shard_counts, merge_run
from generation_core.shard.adaptive import shard_rewards
from generation_core.store.commit_log import ShardCheckpoint
from tests.adaptive_shard import K, N, run_one_shard
from tests.conftest import REPO, write_parquet

pytestmark = pytest.mark.timeout(300)

REWARD = '''
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if ground_truth in ("yes", "no"):
        return float(ground_truth == "yes")
    return float(hashlib.sha256(solution_str.encode()).digest()[0] % 2)
'''


def _inputs(tmp_path):
    rows = [
        {"data_source": "t", "prompt": [{"role": "user", "content": f"Question {i}?"}], "ability": "t",
         "reward_model": {"style": "rule", "ground_truth": ("yes", "no", "half")[i % 3]}, "extra_info": {"index": i}}
        for i in range(9)
    ]
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return write_parquet(tmp_path / "prompts.parquet", rows), reward


def _samples(folder) -> dict[int, list[float | None]]:
    """Each prompt's committed rewards in rollout order."""
    [shard] = folder.list("shards")
    return {index: [by_rollout[r] for r in sorted(by_rollout)] for index, by_rollout in shard_rewards(folder, shard, ShardCheckpoint.load(folder, shard)).items()}


def _keys(folder) -> list[str]:
    [shard] = folder.list("shards")
    return sorted(ShardCheckpoint.load(folder, shard).completed)


def test_adaptive_sampling_stops_decided_prompts_and_resumes_exactly(tmp_path, model_dir):
    prompts, reward = _inputs(tmp_path)
    plan, marker = run_one_shard(prompts, reward, tmp_path / "whole", model_dir)
    rewards = _samples(plan.folder)
    decided = [index for index, r in rewards.items() if len(r) == K]
    # Every sure prompt (yes: all pass, no: all fail) stops after K; the mixed ones that disagree get N.
    assert {i for i in range(9) if i % 3 != 2} <= set(decided)
    for index, r in rewards.items():
        assert len(r) == (K if index in decided else N)
        assert (index in decided) == (len({x > 0 for x in r[:K]}) == 1)
    assert any(len(r) == N for r in rewards.values()), "some prompt needs its second round"
    assert marker.num_trajectories + marker.not_owed == 9 * N and marker.not_owed == len(decided) * (N - K)
    check_shard_counts([marker], N, adaptive=True)
    merged = merge_run(plan.folder, prompt_length=64, response_length=16, pad_token_id=0)
    assert len(merged) == marker.num_trajectories
    with pytest.raises(GenrunError, match="accounts for"):
        check_shard_counts([marker], N, adaptive=False)

    # kill -9 after the third part is written (round 1), then the same command resumes.
    env = {**os.environ, "PYTHONPATH": str(REPO), "GENRUN_FAILPOINTS": "after_part_write@3:kill"}
    args = [sys.executable, "-m", "tests.adaptive_shard", str(prompts), str(reward), str(tmp_path / "killed"), str(model_dir)]
    killed = subprocess.run(args, env=env, cwd=REPO, capture_output=True, timeout=240)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed_plan, resumed = run_one_shard(prompts, reward, tmp_path / "killed", model_dir)
    assert resumed.attempts == 2
    assert _keys(resumed_plan.folder) == _keys(plan.folder)
    assert _samples(resumed_plan.folder) == rewards
    assert (resumed.num_trajectories, resumed.not_owed) == (marker.num_trajectories, marker.not_owed)
