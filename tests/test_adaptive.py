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
from generation_core.outputs.status import print_status
from generation_core.outputs.summary import summarize
from generation_core.shard.adaptive import shard_rewards
from generation_core.shard.attempt import ShardGeneration, TooManyFailedSamples
from generation_core.store.commit_log import ShardCheckpoint
from tests.adaptive_shard import K, N, run_one_shard
from tests.conftest import REPO, write_parquet

pytestmark = pytest.mark.timeout(300)

REWARD = """
import hashlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if ground_truth in ("yes", "no"):
        return float(ground_truth == "yes")
    return float(hashlib.sha256(solution_str.encode()).digest()[0] % 2)
"""


def _inputs(tmp_path):
    rows = [
        {
            "data_source": "t",
            "prompt": [{"role": "user", "content": f"Question {i}?"}],
            "ability": "t",
            "reward_model": {"style": "rule", "ground_truth": ("yes", "no", "half")[i % 3]},
            "extra_info": {"index": i},
        }
        for i in range(9)
    ]
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return write_parquet(tmp_path / "prompts.parquet", rows), reward


def _samples(folder) -> dict[int, list[float | None]]:
    """Each prompt's committed rewards in rollout order."""
    [shard] = folder.list("shards")
    return {
        index: [by_rollout[r] for r in sorted(by_rollout)]
        for index, by_rollout in shard_rewards(folder, shard, ShardCheckpoint.load(folder, shard)).items()
    }


def _keys(folder) -> list[str]:
    [shard] = folder.list("shards")
    return sorted(ShardCheckpoint.load(folder, shard).completed)


def test_adaptive_sampling_stops_decided_prompts_and_resumes_exactly(tmp_path, model_dir, capsys):
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
    # What the summary and `genrun status` say: drawn and not needed, not "26/48" as if unfinished (issue 51 item 2).
    assert summarize(plan, [marker], 1.0)["not_needed"] == marker.not_owed
    print_status(plan.folder.url)
    drawn = f"{marker.num_trajectories}/{9 * N} drawn, {marker.not_owed} not needed"
    out = capsys.readouterr().out
    assert f"done     {drawn}\n" in out and f"trajectories {drawn} (adaptive sampling);" in out, out

    # kill -9 after the third part is written (round 1), then the same command resumes.
    env = {**os.environ, "PYTHONPATH": str(REPO), "GENRUN_FAILPOINTS": "after_part_write@3:kill"}
    args = [
        sys.executable,
        "-m",
        "tests.adaptive_shard",
        str(prompts),
        str(reward),
        str(tmp_path / "killed"),
        str(model_dir),
    ]
    killed = subprocess.run(args, env=env, cwd=REPO, capture_output=True, timeout=240)
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed_plan, resumed = run_one_shard(prompts, reward, tmp_path / "killed", model_dir)
    assert resumed.attempts == 2
    assert _keys(resumed_plan.folder) == _keys(plan.folder)
    assert _samples(resumed_plan.folder) == rewards
    assert (resumed.num_trajectories, resumed.not_owed) == (marker.num_trajectories, marker.not_owed)


class Killed(Exception):
    """Where a test ends an attempt, as a kill there would (nothing after it is written)."""


def _rollouts_per_prompt(keys: list[str]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for key in keys:
        index = int(key.split(":")[0])
        counts[index] = counts.get(index, 0) + 1
    return counts


@pytest.mark.timeout(120)
def test_a_round_one_failure_keeps_its_prompt_undecided_after_a_kill(tmp_path, model_dir, monkeypatch):
    """Issue 43 item 5 / audit #14: sample (0, 1) fails in round 1, so prompt 0 is undecided. Uninterrupted,
    round 2 draws (0, 2) and (0, 3), the failure fails the attempt (max_failed_fraction=0) and the retry
    regenerates (0, 1). Killed after the failure's commit record, before round 2, the resumed attempt's round 1
    retried (0, 1), it passed, and prompt 0 ("yes": all pass) was decided: (0, 2) and (0, 3) were never drawn.
    The failure counted in the commit record keeps prompt 0 undecided: both runs commit the same sample keys."""
    prompts, reward = _inputs(tmp_path)
    with pytest.raises(TooManyFailedSamples):
        run_one_shard(prompts, reward, tmp_path / "whole", model_dir, failures={(0, 1): 1})
    whole_plan, whole = run_one_shard(prompts, reward, tmp_path / "whole", model_dir)

    def killed_before_round_two(self):
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(ShardGeneration, "second_round", killed_before_round_two)
        with pytest.raises(Killed):
            run_one_shard(prompts, reward, tmp_path / "killed", model_dir, failures={(0, 1): 1})
    resumed_plan, resumed = run_one_shard(prompts, reward, tmp_path / "killed", model_dir)

    assert _rollouts_per_prompt(_keys(whole_plan.folder))[0] == N
    assert _keys(resumed_plan.folder) == _keys(whole_plan.folder)
    assert (resumed.attempts, resumed.num_trajectories, resumed.not_owed) == (2, whole.num_trajectories, whole.not_owed)


@pytest.mark.timeout(120)
def test_round_two_waits_for_a_round_one_that_gave_up(tmp_path, model_dir):
    """Issue 43 item 5: with max_inflight=1 the attempt gives up at its second failed sample ((1, 0) and (1, 1)),
    before round 1 reached most prompts. Round 2 then drew all n rollouts of every prompt round 1 had not
    decided, including the ones it never reached, and those stay undecided for good. Round 2 waits for a round 1
    that drew every prompt: the shard commits the sample keys of a run whose round 1 did not give up."""
    prompts, reward = _inputs(tmp_path)
    failures = {(1, 0): 1, (1, 1): 1}
    with pytest.raises(TooManyFailedSamples):
        run_one_shard(prompts, reward, tmp_path / "whole", model_dir, failures=failures)
    whole_plan, whole = run_one_shard(prompts, reward, tmp_path / "whole", model_dir)

    with pytest.raises(TooManyFailedSamples):
        run_one_shard(prompts, reward, tmp_path / "gave_up", model_dir, "generation.max_inflight=1", failures=failures)
    gave_up_plan, gave_up = run_one_shard(prompts, reward, tmp_path / "gave_up", model_dir, "generation.max_inflight=1")

    assert _rollouts_per_prompt(_keys(whole_plan.folder))[1] == N
    assert _keys(gave_up_plan.folder) == _keys(whole_plan.folder)
    assert (gave_up.num_trajectories, gave_up.not_owed) == (whole.num_trajectories, whole.not_owed)
