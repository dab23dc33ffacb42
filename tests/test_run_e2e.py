"""The whole run in one process with the real model and a real local Ray: outputs, resume, refusal."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.protocol import DataProto

from generation_core.driver.in_process import run_in_process
from generation_core.errors import GenrunError
from generation_core.outputs.merge import merge_run
from generation_core.preflight.preflight import preflight
from generation_core.store.trajectory_record import TrajectoryRecord, records_to_parquet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _overrides(prompts_file, out_dir, *extra):
    return [
        f"data.train_files={prompts_file}",
        f"trainer.default_local_dir={out_dir}",
        "actor_rollout_ref.rollout.temperature=0",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "data.max_prompt_length=64",
        "data.max_response_length=24",
        "generation.save_batch_size=4",
        "generation.show_progress=false",
        *extra,
    ]


def test_end_to_end_then_resume_is_a_no_op(ray_local, prompts_file, model_dir, tmp_path):
    out = tmp_path / "run"
    plan = preflight(_overrides(prompts_file, out))
    summary = run_in_process(plan)
    assert summary["num_trajectories"] == 12
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert len(data) == 12
    assert data.non_tensor_batch["index"].tolist() == list(range(12))

    batch = data.batch
    prompt_len, response_len = 64, 24
    assert batch["prompts"].shape == (12, prompt_len) and batch["responses"].shape == (12, response_len)
    response_attention = batch["attention_mask"][:, prompt_len:]
    assert (response_attention.sum(dim=1) > 0).all(), "every response is non-empty"
    # Single-turn: every real response token is a model token.
    assert torch.equal(batch["response_mask"], response_attention)
    # Prompts are left-padded, responses right-padded, and attention follows them.
    for row in range(12):
        prompt_real = batch["attention_mask"][row, :prompt_len]
        assert torch.equal(prompt_real, torch.sort(prompt_real).values)
        length = int(response_attention[row].sum())
        assert response_attention[row, :length].all() and not response_attention[row, length:].any()
    logprobs = batch["rollout_log_probs"]
    assert torch.isfinite(logprobs).all()
    assert (logprobs[response_attention == 0] == 0).all()

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    for row in (0, 5, 11):
        prompt = batch["prompts"][row][batch["attention_mask"][row, :prompt_len].bool()].tolist()
        length = int(response_attention[row].sum())
        response = batch["responses"][row, :length].tolist()
        with torch.no_grad():
            scores = reference(torch.tensor([prompt + response])).logits[0].log_softmax(-1)
        rescored = torch.tensor([scores[len(prompt) - 1 + j, t].item() for j, t in enumerate(response)])
        assert (rescored - logprobs[row, :length]).abs().max().item() < 1e-3

    first_bytes = (out / "trajectories.pkl").read_bytes()
    again = run_in_process(preflight(_overrides(prompts_file, out)))
    assert again["this_invocation"]["trajectories"] == 0
    assert (out / "trajectories.pkl").read_bytes() == first_bytes, "re-merging the same parts is byte-identical"

    # An orphan part (written, never checkpointed) is ignored by the merge.
    orphan = TrajectoryRecord(999, 0, [1, 2], [3], [1], [-1.0], None, 2, {}, {}, {})
    (out / "shards" / "shard-00000" / "batch-00099-deadbeef.parquet").write_bytes(records_to_parquet([orphan]))
    merged = merge_run(
        plan.folder, prompt_length=prompt_len, response_length=response_len, pad_token_id=plan.pad_token_id
    )
    assert len(merged) == 12 and 999 not in merged.non_tensor_batch["index"].tolist()


def test_a_folder_holding_another_run_is_refused(ray_local, prompts_file, tmp_path):
    out = tmp_path / "run"
    # A run claims its folder (run.json) once it holds the lease; the preflight only reads it.
    preflight(_overrides(prompts_file, out)).claim_folder()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(GenrunError, match="holds a different run.*To start fresh"):
        preflight(_overrides(prompts_file, out, "actor_rollout_ref.rollout.temperature=0.7"))
    assert sorted(p.name for p in out.iterdir()) == before
