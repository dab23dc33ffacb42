"""The run fingerprint covers what shapes the trajectories and nothing else: the same command
with a changed output key (an engine setting, the model's weights, the agent-loop YAML, the
tool config) is refused on the folder of the first run, a changed operational key resumes, and
a folder written by an earlier fingerprint recipe says so. Preflight + claim on a tmp folder,
no Ray."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from generation_core.errors import GenrunError
from generation_core.preflight import model_identity, preflight

pytestmark = pytest.mark.timeout(600)

ENGINE = "actor_rollout_ref.rollout.engine_kwargs"


def _args(prompts_file, out, *extra):
    return [
        f"data.train_files={prompts_file}",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.name=instant",
        "generation.show_progress=false",
        *extra,
    ]


def _claimed(prompts_file, out, *extra):
    plan = preflight(_args(prompts_file, out, *extra))
    plan.claim_folder()
    return plan, (out / "run.json").read_bytes()


def test_an_output_key_change_is_refused_and_an_operational_change_resumes(tmp_path, prompts_file, model_dir):
    out = tmp_path / "run"
    plan, run_json = _claimed(prompts_file, out)
    assert json.loads(run_json)["fingerprint_version"] >= 2
    # Operational keys, all changed at once: the same run, resumed.
    operational = (
        "generation.max_inflight=3",
        "generation.request_timeout=30",
        f"{ENGINE}.hf.num_threads=1",
        f"{ENGINE}.instant.delay_seconds=0.5",
        f"{ENGINE}.remote.connect_timeout=3",
        f"{ENGINE}.remote.base_urls=[http://127.0.0.1:1]",
    )
    assert preflight(_args(prompts_file, out, *operational)).fingerprint == plan.fingerprint
    # Engine settings that shape the trajectories (test_config checks the rest key by key).
    for output in (f"{ENGINE}.instant.response_tokens=4", f"{ENGINE}.hf.dtype=bfloat16", f"{ENGINE}.hf.ignore_eos=true", f"{ENGINE}.remote.model=another-model"):
        with pytest.raises(GenrunError, match="holds a different run .*To start fresh") as refused:
            preflight(_args(prompts_file, out, output))
        assert "\n" not in str(refused.value)
    assert (out / "run.json").read_bytes() == run_json, "a refused run changes nothing"


def _tiny_model(path, tokenizer_dir, seed):
    """A random two-layer Llama with the bundled tokenizer (so the prompts tokenize as usual)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def test_the_models_weights_are_in_the_fingerprint_and_a_copy_is_the_same_model(tmp_path, prompts_file, model_dir):
    first = _tiny_model(tmp_path / "model-a", model_dir, seed=0)
    out = tmp_path / "run"
    plan, _ = _claimed(prompts_file, out, f"actor_rollout_ref.model.path={first}")
    # A copy elsewhere (new path, new modification times) is the same model: the run resumes.
    copy = tmp_path / "elsewhere" / "model-a"
    shutil.copytree(first, copy)
    assert model_identity(copy) == model_identity(first)
    assert preflight(_args(prompts_file, out, f"actor_rollout_ref.model.path={copy}")).fingerprint == plan.fingerprint
    # Other weights of the same shapes in the same folder (another checkpoint): another run.
    retrained = _tiny_model(tmp_path / "model-b", model_dir, seed=1)
    assert (retrained / "model.safetensors").stat().st_size == (first / "model.safetensors").stat().st_size
    shutil.copy(retrained / "model.safetensors", copy / "model.safetensors")
    assert model_identity(copy) != model_identity(first)
    with pytest.raises(GenrunError, match="holds a different run"):
        preflight(_args(prompts_file, out, f"actor_rollout_ref.model.path={copy}"))
    # A tokenizer or generation-config edit is another run too.
    shutil.copy(first / "model.safetensors", copy / "model.safetensors")
    generation_config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps(dict(generation_config, eos_token_id=[2, 0])))
    assert model_identity(copy) != model_identity(first)


def test_agent_loop_yaml_and_tool_config_are_in_the_fingerprint(tmp_path, prompts_file, model_dir):
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: my_single_turn\n  _target_: verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")
    extra = (f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    out = tmp_path / "run"
    plan, _ = _claimed(prompts_file, out, *extra)
    assert preflight(_args(prompts_file, out, *extra)).fingerprint == plan.fingerprint
    loops.write_text(loops.read_text() + "- name: another_loop\n  _target_: verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop\n")
    with pytest.raises(GenrunError, match="holds a different run"):
        preflight(_args(prompts_file, out, *extra))
    loops.write_text(loops.read_text().split("- name: another_loop")[0])
    tools.write_text("tools: []\n# a new tool goes here\n")
    with pytest.raises(GenrunError, match="holds a different run"):
        preflight(_args(prompts_file, out, *extra))


def test_a_folder_of_an_earlier_fingerprint_recipe_says_so(tmp_path, prompts_file, model_dir):
    out = tmp_path / "run"
    _, run_json = _claimed(prompts_file, out)
    # What the previous genrun wrote: no fingerprint_version, a fingerprint of its own recipe.
    earlier = json.loads(run_json)
    del earlier["fingerprint_version"]
    earlier["fingerprint"] = "e" * 64
    (out / "run.json").write_text(json.dumps(earlier))
    with pytest.raises(GenrunError) as refused:
        preflight(_args(prompts_file, out))
    message = str(refused.value)
    assert "written by an earlier genrun whose fingerprint did not cover engine_kwargs" in message
    assert "Finish it with that genrun version" in message and "To start fresh, set another trainer.default_local_dir" in message
    assert "\n" not in message
    assert json.loads((out / "run.json").read_text()) == earlier, "nothing changed"
