"""Custom agent loops: the example self-refine loop's mechanics with a scripted engine, unknown
names refused before generation, and one real-model run where tool_agent, the self-refine loop
(verl.plugins entry point and YAML) and a user's own plugin package all run in Ray workers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.protocol import DataProto
from verl.workers.rollout.replica import TokenOutput

from generation_core.config.loading import load_config
from generation_core.shard.streaming import StreamingWorker
from tests.conftest import REPO, chat_rows, run_genrun, write_parquet

pytestmark = pytest.mark.timeout(600)

REPLIES = ["First answer.", "It is too short.", "A better, longer answer."]


class ReplyInTurn:
    """Answers the k-th request of a conversation with REPLIES[k]."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.turn = 0

    def tokens(self, turn):
        return self.tokenizer.encode(REPLIES[turn], add_special_tokens=False) + [self.tokenizer.eos_token_id]

    async def generate(self, request_id, *, prompt_ids, sampling_params, **_unused):
        tokens = self.tokens(self.turn)
        self.turn += 1
        return TokenOutput(token_ids=tokens, log_probs=[-1.0] * len(tokens), stop_reason="completed")


def test_self_refine_masks_the_user_turns(model_dir):
    from verl.utils import hf_tokenizer

    from examples.self_refine.self_refine_loop import CRITIQUE_REQUEST, REVISE_REQUEST

    tokenizer = hf_tokenizer(str(model_dir))
    cfg = load_config(
        [
            "actor_rollout_ref.rollout.agent.default_agent_loop=self_refine",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
        ]
    )
    cfg.actor_rollout_ref.model.path = str(model_dir)
    engine = ReplyInTurn(tokenizer)
    worker = StreamingWorker(cfg, engine)
    sample = {"raw_prompt": [{"role": "user", "content": "Say something."}], "agent_name": "self_refine", "index": 0}
    record = asyncio.run(worker.run_one((0, 0), sample))

    def user_turn(text):
        return tokenizer.encode(
            f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
        )

    turns = [
        (engine.tokens(0), 1),
        (user_turn(CRITIQUE_REQUEST), 0),
        (engine.tokens(1), 1),
        (user_turn(REVISE_REQUEST), 0),
        (engine.tokens(2), 1),
    ]
    assert record.response_ids == [t for ids, _ in turns for t in ids]
    assert record.response_mask == [m for ids, m in turns for _ in ids]
    assert record.response_logprobs == [-1.0 if m else 0.0 for ids, m in turns for _ in ids]
    assert record.num_turns == 6 and record.extra_fields["self_refine_turns"] == [len(ids) for ids, _ in turns]


class CountedLoop(SingleTurnAgentLoop):
    """A user's loop built on verl's: it may keep a sample's state on itself, so each sample builds its own."""

    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountedLoop.built += 1


@pytest.mark.timeout(120)
def test_verls_loops_are_copied_per_sample_and_a_users_loop_is_built_per_sample(model_dir, monkeypatch):
    """Issue 46 item 1: verl's own single-turn and tool loops are built once per worker and event
    loop, each sample getting a copy equal to a fresh construction (their constructor's OmegaConf
    reads were most of genrun's CPU per trajectory); a user's loop is still constructed per sample."""
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    from generation_core.verl_adapter import agent_loop_arguments, register_agent_loop

    cfg = load_config(
        [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={REPO / 'examples/tool_calling/tools.yaml'}"]
    )
    cfg.actor_rollout_ref.model.path = str(model_dir)
    worker = StreamingWorker(cfg, ReplyInTurn(None))
    constructed = []
    for verl_class in (SingleTurnAgentLoop, ToolAgentLoop):
        monkeypatch.setattr(verl_class, "__init__", _counting(verl_class.__init__, constructed))
    monkeypatch.setitem(verl_agent_loop._agent_loop_registry, "counted_loop", None)
    register_agent_loop("counted_loop", OmegaConf.create({"_target_": f"{__name__}.CountedLoop"}))
    CountedLoop.built = 0

    async def build_each_twice():
        loops = {
            name: [worker.build_agent_loop(name) for _ in range(2)] for name in ("single_turn_agent", "tool_agent")
        }
        fresh = {
            "single_turn_agent": SingleTurnAgentLoop(**agent_loop_arguments(worker.worker)),
            "tool_agent": ToolAgentLoop(**agent_loop_arguments(worker.worker)),
        }
        return loops, fresh, [worker.build_agent_loop("counted_loop") for _ in range(2)]

    loops, fresh, counted = asyncio.run(build_each_twice())

    def state(loop):
        # The tool parser is a new object per construction (it keeps no state either).
        return {key: value for key, value in vars(loop).items() if key != "tool_parser"}

    for name, (first, second) in loops.items():
        assert first is not second and type(first) is type(second) is type(fresh[name])
        assert state(first) == state(second) == state(fresh[name])
    assert sorted(constructed) == ["SingleTurnAgentLoop", "SingleTurnAgentLoop", "ToolAgentLoop", "ToolAgentLoop"], (
        "one build per loop for the samples, one for the fresh comparison"
    )
    assert counted[0] is not counted[1] and CountedLoop.built == 2


def _counting(init, constructed):
    def counted(self, *args, **kwargs):
        if type(self).__name__ in ("SingleTurnAgentLoop", "ToolAgentLoop"):
            constructed.append(type(self).__name__)
        init(self, *args, **kwargs)

    return counted


def _user_plugin(site):
    """A user's own package, installed only as a dist-info with a verl.plugins entry point."""
    (site / "my_loops.py").write_text(
        textwrap.dedent("""
        from verl.experimental.agent_loop.agent_loop import register
        from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

        @register("user_plugin_loop")
        class UserPluginLoop(SingleTurnAgentLoop):
            async def run(self, sampling_params, **kwargs):
                output = await super().run(sampling_params, **kwargs)
                import ray
                output.extra_fields["in_ray_worker"] = ray._private.worker.global_worker.mode == ray.WORKER_MODE
                return output
    """)
    )
    dist = site / "my_loops-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-loops\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[verl.plugins]\nmy_loops = my_loops\n")
    # The example self-refine loop, installed as its README says (genrun itself declares no
    # plugin: every install would import it).
    install_self_refine_example(site)


def install_self_refine_example(site: Path) -> None:
    """examples/self_refine installed as docs/agents.md says (its pyproject.toml, a verl.plugins
    entry point), into `site` (a folder for PYTHONPATH) instead of the venv: built from a copy, so
    the checkout gets no build folders."""
    source = site.parent / "self_refine_source"
    shutil.copytree(
        REPO / "examples" / "self_refine", source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(site.parent / "wheel")],
        check=True,
        timeout=120,
        capture_output=True,
    )
    (wheel,) = (site.parent / "wheel").glob("*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=120, capture_output=True
    )


@pytest.mark.timeout(300)
def test_the_self_refine_example_installed_as_documented_registers_its_loop(tmp_path):
    """Issue 45 item 8: `default_agent_loop=self_refine` (the first way docs/agents.md shows)
    works once the example is installed with its pyproject.toml: a fresh process finds the loop
    through verl's plugin entry point."""
    site = tmp_path / "site"
    site.mkdir()
    install_self_refine_example(site)
    probe = (
        "from generation_core.config.loading import load_config\n"
        "from generation_core.inputs.agent_loops import check_agent_loops\n"
        "check_agent_loops(load_config(['actor_rollout_ref.rollout.agent.default_agent_loop=self_refine']), {'self_refine'})\n"
        "print('registered')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("registered"), done.stderr[-2000:]


# Extended: make test holds each loop on its own: the self-refine masks (test_self_refine_masks_the_user_turns), the example installed as a plugin (test_the_self_refine_example_installed_as_documented_registers_its_loop), verl's tool loop token by token (tests/test_tool_loop.py) and agent loops in Ray workers (every CLI run).
@pytest.mark.extended
@pytest.mark.slow
def test_real_model_runs_tool_self_refine_yaml_and_plugin_loops_in_ray_workers(tmp_path, model_dir, prefect_server):
    site = tmp_path / "site"
    site.mkdir()
    _user_plugin(site)
    agents = ["tool_agent", "self_refine", "self_refine_yaml", "user_plugin_loop"]
    rows = chat_rows(8)
    for position, row in enumerate(rows):
        row["agent_name"] = agents[position % 4]
    prompts = write_parquet(tmp_path / "mixed.parquet", rows)
    out = tmp_path / "run"
    env = dict(prefect_server.env, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]))
    args = [
        f"data.train_files={prompts}",
        f"trainer.default_local_dir={out}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={REPO / 'examples/tool_calling/tools.yaml'}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={REPO / 'examples/self_refine/agent_loop.yaml'}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "data.max_prompt_length=128",
        "data.max_response_length=128",
        "generation.num_shards=2",
        "generation.show_progress=false",
    ]
    result = run_genrun(args, env=env, timeout=540)
    assert result.returncode == 0, result.stderr[-4000:]
    data = DataProto.load_from_disk(str(out / "trajectories.pkl"))
    assert len(data) == 8 and data.non_tensor_batch["index"].tolist() == list(range(8))
    names = data.non_tensor_batch["agent_name"].tolist()
    mask, logprobs = data.batch["response_mask"], data.batch["rollout_log_probs"]
    assert data.batch["responses"].shape == (8, 128) and data.batch["prompts"].shape == (8, 128)
    assert logprobs[mask == 0].eq(0).all(), "logprob 0 wherever the model did not write the token"
    assert (logprobs[mask == 1] < 0).all(), "a real logprob on every model token"
    turns = data.non_tensor_batch["__num_turns__"].tolist()
    for row, name in enumerate(names):
        if name.startswith("self_refine"):
            lengths = data.non_tensor_batch["self_refine_turns"][row]
            # Each turn's tokens: model (1), user (0), model, user, model, cut at response_length.
            expected = [m for turn, length in enumerate(lengths) for m in [1 - turn % 2] * length][:128]
            assert mask[row, : len(expected)].tolist() == expected
            assert turns[row] == 1 + len(lengths) and len(lengths) >= 3, "answer, critique request, critique at least"
        elif name == "user_plugin_loop":
            assert turns[row] == 2 and mask[row].sum() > 0
            assert data.non_tensor_batch["in_ray_worker"][row] is True, "the shard ran in a Ray worker"
        else:
            assert name == "tool_agent" and turns[row] >= 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["num_trajectories"] == 8 and manifest["failed_samples"] == 0
