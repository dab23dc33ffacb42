"""The merge pads exactly as verl's AgentLoopWorker: compared with verl's own code on the same outputs."""

import asyncio

import numpy as np
import pytest
import torch
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

from generation_core.config import load_config
from generation_core.merge import build_dataproto
from generation_core.streaming import StreamingWorker

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def worker(model_dir):
    cfg = load_config(["data.max_prompt_length=16", "data.max_response_length=12"])
    return StreamingWorker(cfg, llm_client=None)


def _outputs(with_logprobs: bool, with_rewards: bool) -> list[AgentLoopOutput]:
    specs = [
        ([1, 5, 9, 13, 17], [21, 22, 23, 24, 25, 26, 2], [1] * 7, 1.0),
        ([3, 4, 5], [30, 31, 40, 41, 32], [1, 1, 0, 0, 1], 0.5),
        ([7] * 16, [8] * 12, [1] * 12, -2.0),
        ([9, 10], [], [], 0.0),
    ]
    outputs = []
    for i, (prompt, response, mask, reward) in enumerate(specs):
        logprobs = [(-0.1 * (j + 1)) if m else 0.0 for j, m in enumerate(mask)] if with_logprobs else None
        outputs.append(
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=mask,
                response_logprobs=logprobs,
                reward_score=reward if (with_rewards or i % 2 == 0) else None,
                num_turns=2 + 2 * (i % 2),
                metrics=AgentLoopMetrics(generate_sequences=0.1 * i),
                extra_fields={"turn_scores": [], "tool_rewards": [0.5] if i == 1 else [], "min_global_steps": None, "max_global_steps": None},
            )
        )
    return outputs


def _kwargs(i: int) -> dict:
    return {
        "data_source": "test",
        "raw_prompt": [{"role": "user", "content": f"q{i}"}],
        "reward_model": {"style": "rule", "ground_truth": str(i)},
        "extra_info": {"index": 100 + i},
        "index": 100 + i,
        "tools_kwargs": {},
        "interaction_kwargs": {},
        "agent_name": "single_turn_agent",
    }


@pytest.mark.parametrize("with_logprobs, with_rewards", [(True, True), (False, False)])
def test_merge_equals_verl_postprocess(worker, with_logprobs, with_rewards):
    verl_worker = worker.worker
    kwargs = [_kwargs(i) for i in range(4)]

    async def verl_side():
        return [await verl_worker._agent_loop_postprocess(o, False, **kw) for o, kw in zip(_outputs(with_logprobs, with_rewards), kwargs)]

    padded = asyncio.run(verl_side())
    non_tensor_input = {key: np.fromiter([kw[key] for kw in kwargs], dtype=object, count=4) for key in kwargs[0]}
    expected = verl_worker._postprocess(padded, input_non_tensor_batch=non_tensor_input)

    # Our path: the same agent-loop outputs as unpadded records (as streamed to disk), merged.
    records = [worker.record_from_output((kw["index"], 0), out, kw) for out, kw in zip(_outputs(with_logprobs, with_rewards), kwargs)]
    merged = build_dataproto(records, prompt_length=16, response_length=12, pad_token_id=verl_worker.tokenizer.pad_token_id)

    assert sorted(merged.batch.keys()) == sorted(expected.batch.keys())
    assert ("rm_scores" in merged.batch.keys()) == with_rewards
    assert ("rollout_log_probs" in merged.batch.keys()) == with_logprobs
    for key in expected.batch.keys():
        ours, theirs = merged.batch[key], expected.batch[key]
        assert ours.dtype == theirs.dtype, key
        assert ours.shape == theirs.shape, key
        assert torch.equal(ours, theirs), key
    assert sorted(merged.non_tensor_batch) == sorted(expected.non_tensor_batch)
    for key, theirs in expected.non_tensor_batch.items():
        ours = merged.non_tensor_batch[key]
        assert ours.dtype == theirs.dtype, key
        assert ours.tolist() == theirs.tolist(), key
    assert merged.meta_info == expected.meta_info


def test_reward_extra_keys_that_vary_per_sample_become_columns_with_gaps():
    from generation_core.records import TrajectoryRecord

    records = [
        TrajectoryRecord(0, 0, [1, 2], [3, 2], [1, 1], None, 1.0, 2, {"index": 0}, {"reward_extra_info": {"score": 1.0, "acc": True}}, {}),
        TrajectoryRecord(1, 0, [1, 2], [4, 2], [1, 1], None, 0.0, 2, {"index": 1}, {"reward_extra_info": {"score": 0.0, "format_error": "no answer"}}, {}),
    ]
    data = build_dataproto(records, prompt_length=4, response_length=4, pad_token_id=2)
    assert data.meta_info["reward_extra_keys"] == ["score", "acc", "format_error"]
    assert data.non_tensor_batch["score"].tolist() == [1.0, 0.0]
    assert data.non_tensor_batch["acc"].tolist() == [True, None]
    assert data.non_tensor_batch["format_error"].tolist() == [None, "no answer"]
