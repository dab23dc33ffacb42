"""generation.sample_seed: every request of a sample carries a seed derived from (seed, index,
rollout_n), so the n samples of a prompt differ on the instant engine and a sampled run resumes
to the same tokens; without it no seed is sent (engines sample freely)."""

import asyncio

import pytest

from generation_core.config.loading import load_config
from generation_core.engines.instant import InstantEngine, InstantSettings
from generation_core.errors import GenrunError
from generation_core.shard.streaming import StreamingWorker, sample_seed

pytestmark = pytest.mark.timeout(120)


class Recording:
    """The instant engine, remembering the sampling parameters of every request."""

    def __init__(self):
        self.engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=2))
        self.seen = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        self.seen.append(dict(sampling_params))
        return await self.engine.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def _responses(model_dir, *overrides):
    cfg = load_config(
        ["actor_rollout_ref.rollout.name=instant", "actor_rollout_ref.rollout.temperature=1.0", *overrides]
    )
    cfg.actor_rollout_ref.model.path = str(model_dir)
    engine = Recording()
    worker = StreamingWorker(cfg, engine)
    sample = {
        "raw_prompt": [{"role": "user", "content": "Say something."}],
        "agent_name": "single_turn_agent",
        "index": 7,
    }
    records = [asyncio.run(worker.run_one((7, n), dict(sample))) for n in range(4)]
    return [r.response_ids for r in records], engine.seen


def test_seeded_samples_of_one_prompt_differ_and_repeat_exactly(model_dir):
    first, seen = _responses(model_dir, "generation.sample_seed=3")
    assert [params["seed"] for params in seen] == [sample_seed(3, (7, n)) for n in range(4)]
    assert len({tuple(r) for r in first}) == 4, "each rollout number gets its own tokens"
    again, _ = _responses(model_dir, "generation.sample_seed=3")
    assert again == first, "the same (index, rollout_n) gets the same tokens in another run"
    other, _ = _responses(model_dir, "generation.sample_seed=4")
    assert other != first


def test_without_a_sample_seed_no_seed_is_sent(model_dir):
    _, seen = _responses(model_dir)
    assert all("seed" not in params for params in seen)


def test_sample_seed_is_refused_where_the_engine_ignores_seeds():
    with pytest.raises(GenrunError, match="generation.sample_seed"):
        load_config(["actor_rollout_ref.rollout.name=sglang", "generation.sample_seed=1"])
    with pytest.raises(GenrunError, match="generation.sample_seed"):
        load_config(["generation.sample_seed=-1"])


def test_seeds_are_stable_and_distinct():
    seeds = {sample_seed(0, (index, n)) for index in range(100) for n in range(8)}
    assert len(seeds) == 800 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(0, (5, 1)) == sample_seed(0, (5, 1))
