"""The user's reward function (generation_core/shard/rewards.py): an `async def` one is awaited on the
run's event loop, and the reward file's content is part of the run fingerprint."""

from __future__ import annotations

import asyncio
import threading

import pytest

from generation_core.config.loading import load_config
from generation_core.errors import GenrunError
from generation_core.preflight.preflight import preflight
from generation_core.shard.rewards import RewardScorer, _as_result

pytestmark = pytest.mark.timeout(300)

ASYNC_REWARD = """
import asyncio
import threading

calls = []

async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    # Suspends: only an awaited coroutine gets past this line.
    await asyncio.sleep(0)
    calls.append((threading.get_ident(), asyncio.get_running_loop()))
    return {"score": 0.75 if ground_truth == "7" else 0.0, "length": len(solution_str)}
"""

SYNC_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0
"""


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


def test_an_async_reward_function_is_awaited_on_the_event_loop(tmp_path, tokenizer):
    reward_file = tmp_path / "async_reward.py"
    reward_file.write_text(ASYNC_REWARD)
    cfg = load_config([f"reward.custom_reward_function.path={reward_file}"])
    scorer = RewardScorer.from_config(cfg, tokenizer)
    assert scorer.is_async, "an async def reward (verl wraps it in a partial) is recognised as async"
    response_ids = tokenizer.encode("The answer is 7.", add_special_tokens=False)
    sample = {"data_source": "test", "reward_model": {"ground_truth": "7"}, "extra_info": {"index": 0}}

    async def score_on_this_loop():
        result = await scorer.score(response_ids, sample, num_turns=2, extra_fields={})
        return result, threading.get_ident(), asyncio.get_running_loop()

    try:
        result, thread, loop = asyncio.run(score_on_this_loop())
    finally:
        scorer.shutdown()
    # Called without await (or in the thread pool as a sync function), the result would be a
    # coroutine: refused as "not a number", and the function body would never run.
    assert result.score == 0.75
    assert result.extra_info == {"score": 0.75, "length": len("The answer is 7.")}
    module = scorer.function.args[0].__globals__
    assert module["calls"] == [(thread, loop)], "awaited once, in the event loop's thread, on the run's loop"


def test_the_reward_files_content_is_in_the_fingerprint(tmp_path, prompts_file, model_dir):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(SYNC_REWARD)
    out = tmp_path / "run"
    args = [
        f"data.train_files={prompts_file}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        f"reward.custom_reward_function.path={reward_file}",
        "generation.show_progress=false",
    ]
    plan = preflight(args)
    plan.claim_folder()
    run_json = (out / "run.json").read_bytes()
    assert preflight(args).fingerprint == plan.fingerprint, "the same reward file: the same run"

    # Same path, other scores: another run, refused on this folder.
    reward_file.write_text(SYNC_REWARD.replace("return 1.0", "return 0.0"))
    with pytest.raises(GenrunError, match="holds a different run") as refused:
        preflight(args)
    assert "\n" not in str(refused.value)
    assert (out / "run.json").read_bytes() == run_json, "a refused run changes nothing"


def test_a_nan_score_is_no_score():
    """NaN from a reward function is no score (None), as a missing one: one rule everywhere."""
    assert _as_result(float("nan")).score is None and _as_result({"score": float("nan"), "acc": 0}).score is None
    assert _as_result(0.5).score == 0.5


def test_without_a_reward_function_verls_default_scorer_scores_by_data_source(tokenizer):
    """Issue 45 item 2: with no reward.custom_reward_function, verl scores by data_source
    (default_compute_score), and so does genrun: a gsm8k row with its ground truth is scored by
    verl's gsm8k scorer; a data_source verl has no scorer for, a row without a ground truth and
    verl's code data sources (its default would run the model's code unsandboxed) get no score."""
    from verl.utils.reward_score import default_compute_score

    from generation_core.shard.rewards import NO_SCORE

    scorer = RewardScorer.from_config(load_config([]), tokenizer)

    def score(text: str, data_source: str, ground_truth: str | None):
        sample = {
            "data_source": data_source,
            "reward_model": {"ground_truth": ground_truth},
            "extra_info": {"index": 0},
        }
        return asyncio.run(
            scorer.score(tokenizer.encode(text, add_special_tokens=False), sample, num_turns=2, extra_fields={})
        )

    try:
        right, wrong = (
            score("So she has #### 72", "openai/gsm8k", "72"),
            score("So she has #### 71", "openai/gsm8k", "72"),
        )
        assert (right.score, wrong.score) == (1.0, 0.0)
        assert right.score == default_compute_score("openai/gsm8k", "So she has #### 72", "72")
        assert score("#### 72", "genrun/instructions", "72") is NO_SCORE
        assert "genrun/instructions" in scorer.unscored_sources, "an unknown source is asked once"
        assert score("#### 72", "openai/gsm8k", None) is NO_SCORE and score("#### 72", "openai/gsm8k", "") is NO_SCORE
        assert score("print(1)", "apps", "[]") is NO_SCORE
    finally:
        scorer.shutdown()
