"""Adaptive sampling (`generation.adaptive`): a prompt's samples in two rounds, the second only
where the first leaves the outcome open.

Round 1 draws each prompt's rollouts [0, k). When every one of them is committed with a reward
and they all pass (reward > threshold) or all fail, the prompt is decided and rollouts [k, n)
are never drawn: the shard does not owe them (`SuccessMarker.not_owed`). Otherwise round 2
draws them. Round 2 of an attempt starts once its round 1 has drawn every prompt and is wholly
committed (not after a stop, nor after round 1 gave up on too many failed samples: the prompts
it left undrawn would all get n).

The decision reads commit records only, so a shard killed anywhere, stopped or retried draws
exactly the samples an uninterrupted one does. A prompt with any committed rollout >= k was
undecided when round 2 drew it and stays so. A prompt whose sample failed (no reward to decide
on) is undecided, and stays so in every later attempt although the retry of that sample may
pass: the commit record that counts the failure (`ShardCheckpoint.failed_in_any_attempt`) keeps
what the uninterrupted run's round 2 saw. What a kill loses is what was not committed: a
failure after the attempt's last commit record is as if it never happened (the sample is drawn
again in round 1), exactly as a success after it is; the resumed shard then draws what an
uninterrupted run in which that sample did not fail draws.
"""

from __future__ import annotations

from dataclasses import dataclass

from generation_core.config.settings import GenerationSettings
from generation_core.store.commit_log import ShardCheckpoint
from generation_core.store.folder import StorageFolder
from generation_core.store.part_repair import CommittedPartRef, read_verified_part
from generation_core.store.run_folder import shard_file
from generation_core.store.trajectory_record import read_part_table, score_or_none


@dataclass(frozen=True)
class AdaptiveRule:
    n: int
    k: int
    threshold: float

    @classmethod
    def of(cls, settings: GenerationSettings, n: int) -> AdaptiveRule | None:
        """The run's rule (`n`: actor_rollout_ref.rollout.n), None when adaptive sampling is off."""
        if not settings.adaptive:
            return None
        return cls(int(n), settings.adaptive_k, float(settings.adaptive_pass_threshold))

    def decided(self, rewards: dict[int, float | None]) -> bool:
        """Whether a prompt's committed rewards (by rollout_n) decide it after round 1."""
        if any(rollout_n >= self.k for rollout_n in rewards):
            return False
        first = [rewards.get(rollout_n) for rollout_n in range(self.k)]
        if any(reward is None for reward in first):
            return False
        passed = [reward > self.threshold for reward in first if reward is not None]
        return all(passed) or not any(passed)

    def first_round(self, index: int) -> range:
        return range(self.k)

    def second_round(self, decided: set[int]):
        """Rollouts round 2 draws for a prompt: none once decided, else all n."""
        return lambda index: range(0) if index in decided else range(self.n)


def shard_rewards(
    folder: StorageFolder, shard_name: str, checkpoint: ShardCheckpoint
) -> dict[int, dict[int, float | None]]:
    """Every committed sample's reward in a shard, by prompt index and rollout_n."""
    rewards: dict[int, dict[int, float | None]] = {}
    for part in checkpoint.parts:
        table = read_part_table(
            read_verified_part(folder, CommittedPartRef(shard_file(shard_name, part.name), part.sha256)),
            ["index", "rollout_n", "reward_score"],
        )
        for index, rollout_n, reward in zip(
            *(table.column(name).to_pylist() for name in ("index", "rollout_n", "reward_score")), strict=True
        ):
            rewards.setdefault(index, {})[rollout_n] = score_or_none(reward)
    return rewards


def decided_prompts(
    rule: AdaptiveRule, folder: StorageFolder, shard_name: str, checkpoint: ShardCheckpoint
) -> set[int]:
    """The prompts of a shard whose committed round-1 rewards decide them; never one with a sample
    that a commit record of any attempt counts as failed (the module docstring says why)."""
    failed = {int(key.rsplit(":", 1)[0]) for key in checkpoint.failed_in_any_attempt}
    rewards = shard_rewards(folder, shard_name, checkpoint)
    return {index for index, by_rollout in rewards.items() if index not in failed and rule.decided(by_rollout)}
