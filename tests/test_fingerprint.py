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
from generation_core.preflight.fingerprint import model_identity
from generation_core.preflight.preflight import preflight

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
    for output in (
        f"{ENGINE}.instant.response_tokens=4",
        f"{ENGINE}.hf.dtype=bfloat16",
        f"{ENGINE}.hf.ignore_eos=true",
        f"{ENGINE}.remote.model=another-model",
    ):
        with pytest.raises(GenrunError, match="holds a different run .*To start fresh") as refused:
            preflight(_args(prompts_file, out, output))
        assert "\n" not in str(refused.value)
    assert (out / "run.json").read_bytes() == run_json, "a refused run changes nothing"


def _tiny_model(path, tokenizer_dir, seed):
    """A random two-layer Llama with the bundled tokenizer (so the prompts tokenize as usual)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
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
    loops.write_text(
        "- name: my_single_turn\n  _target_: verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop\n"
    )
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools: []\n")
    extra = (
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
    )
    out = tmp_path / "run"
    plan, _ = _claimed(prompts_file, out, *extra)
    assert preflight(_args(prompts_file, out, *extra)).fingerprint == plan.fingerprint
    loops.write_text(
        loops.read_text()
        + "- name: another_loop\n  _target_: verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop\n"
    )
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
    assert f"output folder {out} is in folder format 1 (written by genrun " in message
    assert "this genrun reads format 3 only" in message
    assert (
        "Finish it with that genrun version" in message
        and "To start fresh, set another trainer.default_local_dir" in message
    )
    assert "\n" not in message
    assert json.loads((out / "run.json").read_text()) == earlier, "nothing changed"


def _user_code(root, package):
    """A user's tree: a tool class, an agent loop with a helper, a verl.plugins entry point
    (installed as a dist-info only, as test_custom_loops does), and a reward file that imports a
    helper beside it and installed packages."""
    import textwrap

    src = root / "src"
    (src / package).mkdir(parents=True)
    (src / package / "__init__.py").write_text("")
    (src / package / "tools.py").write_text(
        "from examples.tool_calling.calculator import CalculatorTool\n\n\nclass MyTool(CalculatorTool):\n    pass\n"
    )
    (src / package / "loop_helper.py").write_text("TURNS = 1\n")
    (src / package / "loops.py").write_text(
        textwrap.dedent("""
        from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

        from . import loop_helper


        class MyLoop(SingleTurnAgentLoop):
            turns = loop_helper.TURNS
    """)
    )
    (src / package / "plugin.py").write_text(
        textwrap.dedent(f"""
        from verl.experimental.agent_loop.agent_loop import register
        from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


        @register("{package}_plugin")
        class PluginLoop(SingleTurnAgentLoop):
            pass
    """)
    )
    dist = src / f"{package}_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[verl.plugins]\n{package} = {package}.plugin\n")
    reward = root / "reward"
    reward.mkdir()
    (reward / f"{package}_scoring.py").write_text("def bonus():\n    return 1.0\n")
    (reward / "reward.py").write_text(
        f"import json\n\nimport numpy\nimport verl\n\nfrom generation_core import errors\nfrom {package}_scoring import bonus\n\n\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return bonus()\n"
    )
    tools = root / "tools.yaml"
    tools.write_text(f"tools:\n  - class_name: {package}.tools.MyTool\n    config:\n      type: native\n")
    loops = root / "loops.yaml"
    loops.write_text(f"- name: {package}_loop\n  _target_: {package}.loops.MyLoop\n")
    return (
        src,
        reward,
        (
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
            f"reward.custom_reward_function.path={reward / 'reward.py'}",
        ),
    )


def test_user_code_that_shapes_trajectories_is_in_the_fingerprint(tmp_path, prompts_file, model_dir, monkeypatch):
    """A changed tool class module, a helper the reward file imports, a plugin agent loop and a
    module an agent loop imports each change the fingerprint (each left it unchanged: the same
    command resumed the old folder, mixing old and new trajectories); an unchanged tree gives the
    same fingerprint twice, and an edit undone gives the first one back (content, not time)."""
    import uuid

    from generation_core.build import genrun_build
    from generation_core.config.loading import load_config
    from generation_core.preflight.fingerprint import fingerprint, output_file_digests
    from generation_core.preflight.preflight import check_run_code

    package = f"user_code_{uuid.uuid4().hex[:8]}"
    src, reward, extra = _user_code(tmp_path, package)
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.syspath_prepend(str(reward))  # where the reward file's own import finds its helper
    plan = preflight(_args(prompts_file, tmp_path / "run", *extra))
    assert plan.run_record().build == genrun_build()

    def fingerprint_now():
        cfg = load_config(_args(prompts_file, tmp_path / "run", *extra))
        check_run_code(cfg, {cfg.actor_rollout_ref.rollout.agent.default_agent_loop})
        return fingerprint(cfg, "dataset", output_file_digests(cfg))

    first = fingerprint_now()
    assert fingerprint_now() == first, "an unchanged tree"
    assert preflight(_args(prompts_file, tmp_path / "run", *extra)).fingerprint == plan.fingerprint
    for changed in (
        src / package / "tools.py",
        reward / f"{package}_scoring.py",
        src / package / "plugin.py",
        src / package / "loop_helper.py",
    ):
        source = changed.read_text()
        changed.write_text(source + "# changed\n")
        assert fingerprint_now() != first, f"{changed.name} changed"
        changed.write_text(source)
        assert fingerprint_now() == first, f"{changed.name} restored"


def test_the_code_walk_hashes_local_modules_only(tmp_path, monkeypatch):
    """Installed packages, the standard library and genrun's own modules are not read (they are
    versioned, and a walk through torch would cost seconds); a local module is, by name, once."""
    from generation_core.inputs.user_code import CodeWalk

    (tmp_path / "helper_for_walk.py").write_text(
        "import os\nimport torch\nfrom generation_core.config.loading import load_config\n"
    )
    user_file = tmp_path / "user.py"
    user_file.write_text(
        "import json\nimport numpy\nimport verl\nimport torch\nimport helper_for_walk\nfrom generation_core.preflight import preflight\n"
    )
    walk = CodeWalk()
    walk.add_file(user_file)
    assert sorted(walk.found.sources) == ["helper_for_walk"]
    assert walk.found.distributions == {}
    # A named class in an installed package enters by its distribution (unless already versioned).
    walk.add_module("pyarrow.parquet", named=True)
    assert walk.found.distributions.get("pyarrow")
    assert "pyarrow" not in str(walk.found.sources)
    versioned = CodeWalk(already_versioned=["verl"])
    versioned.add_module("verl.tools.base_tool", named=True)
    assert versioned.found.digest() is None, "verl's version is in the fingerprint already"


def test_each_attempt_records_the_genrun_build_and_status_names_another(tmp_path, capsys):
    from flows.cli import main
    from generation_core.build import describe_build, genrun_build
    from generation_core.store.commit_log import ShardCheckpoint
    from generation_core.store.folder import StorageFolder

    folder = StorageFolder(str(tmp_path / "run"))
    older = dict(genrun_build(), commit="0" * 40, dirty=False)
    folder.put_json(
        "run.json",
        {
            "fingerprint": "f" * 64,
            "rollout_n": 1,
            "pad_token_id": 0,
            "shards": [{"name": "shard-00000", "range": [0, 3]}],
            "build": older,
            "config": {"actor_rollout_ref": {"rollout": {"prompt_length": 4, "response_length": 4}}, "generation": {}},
        },
    )
    ShardCheckpoint.start_attempt(folder, "shard-00000")
    ShardCheckpoint.load(folder, "shard-00000").commit_part(folder, "shard-00000", None, [], failed=["0:0"])
    assert ShardCheckpoint.load(folder, "shard-00000").builds == [genrun_build()]
    assert main(["status", str(tmp_path / "run")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"written by {describe_build(older)}; attempts also by {describe_build(genrun_build())}" in lines
    warnings = [line for line in lines if line.startswith("warning:")]
    assert (
        len(warnings) == 1 and "commit 000000000000" in warnings[0] and "the output format is the same" in warnings[0]
    )


def test_a_folder_of_todays_format_without_a_build_record_resumes_and_says_so(
    tmp_path, prompts_file, model_dir, caplog
):
    """A folder genrun wrote before it recorded builds (same fingerprint recipe, no user code)
    still resumes, with one warning line; one whose output format differs is refused naming it."""
    out = tmp_path / "run"
    plan, run_json = _claimed(prompts_file, out)
    earlier = json.loads(run_json)
    del earlier["build"]
    (out / "run.json").write_text(json.dumps(earlier))
    with caplog.at_level("WARNING", logger="generation_core.preflight.preflight"):
        assert preflight(_args(prompts_file, out)).fingerprint == plan.fingerprint
    warnings = [r.getMessage() for r in caplog.records if "was written by" in r.getMessage()]
    assert len(warnings) == 1 and "a genrun that recorded no build" in warnings[0] and "\n" not in warnings[0]
    # Another output format: another fingerprint, refused with what to do.
    (out / "run.json").write_text(
        json.dumps(dict(earlier, fingerprint="e" * 64, build=dict(plan.run_record().build, output_format=0)))
    )
    with pytest.raises(GenrunError, match="genrun's output format changed .*To start fresh") as refused:
        preflight(_args(prompts_file, out))
    assert "\n" not in str(refused.value)
