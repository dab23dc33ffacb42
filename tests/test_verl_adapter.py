"""Every assumption generation_core/verl_adapter.py makes about verl's internals, pinned to the
installed verl: the version it was written for, the private names and hooks it reaches, and
their behaviour. An upgrade of verl fails here, naming what to re-check, and nowhere else; and
no other module of the library reaches a verl internal without going through the adapter."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import verl
from omegaconf import OmegaConf
from verl.experimental.agent_loop import AgentLoopWorker
from verl.experimental.agent_loop import agent_loop as verl_agent_loop
from verl.protocol import DataProto
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.llm_server import LLMServerManager
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from generation_core import verl_adapter
from generation_core.console import QUIET_AT_ANY_LEVEL
from generation_core.inputs.agent_loops import PLUGIN_GROUP
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)

LIBRARY = ("generation_core", "flows", "tasks")

# verl's private names and hooks the library uses: only verl_adapter.py may spell them.
INTERNAL_NAMES = (
    "_agent_loop_registry",
    "create_continuous_token_builder",
    "DictConfigWrap",
    "ToolListWrap",
    "RolloutReplicaRegistry",
    "RolloutMode",
    "_server_handle",
    "_server_address",
    "_init_global_load_balancer",
    "_download",
    "_read_files_and_tokenize",
    "maybe_filter_out_long_prompts",
    "_generated_ppo_trainer",
)


def _source(function) -> str:
    return textwrap.dedent(inspect.getsource(function))


def _calls(function, name: str) -> list[ast.Call]:
    """The calls of `name` (a plain or dotted name's last part) in `function`'s source."""
    found = []
    for node in ast.walk(ast.parse(_source(function))):
        if isinstance(node, ast.Call):
            callee = node.func
            last = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", None)
            if last == name:
                found.append(node)
    return found


def _assigned_self_attributes(function) -> set[str]:
    """`self.X` names that `function` assigns."""
    names = set()
    for node in ast.walk(ast.parse(_source(function))):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


# ---- the version ----


def test_the_installed_verl_is_the_one_the_adapter_was_written_for():
    assert verl.__version__ == verl_adapter.VERL_VERSION, (
        f"verl {verl.__version__} is installed; generation_core/verl_adapter.py was written against verl "
        f"{verl_adapter.VERL_VERSION}. Re-check each function of verl_adapter.py against the new verl (its docstring "
        "names the verl code it relies on), make every test of tests/test_verl_adapter.py pass, then set VERL_VERSION"
    )


def _names_in_code(path: Path) -> set[str]:
    """Identifiers the module's code uses (names, attributes, imports, definitions) and its
    string constants other than docstrings: prose may name verl's internals, code may not."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names |= {name for name in INTERNAL_NAMES if name in node.value}
    return names


def test_only_the_adapter_uses_verls_internals():
    """A reach into verl's internals elsewhere in the library would escape these pins."""
    used = {}
    for package in LIBRARY:
        for path in sorted((REPO / package).rglob("*.py")):
            if path == REPO / "generation_core" / "verl_adapter.py":
                continue
            names = sorted(_names_in_code(path) & set(INTERNAL_NAMES))
            if names:
                used[str(path.relative_to(REPO))] = names
    assert used == {}


def test_importing_the_adapter_imports_no_verl():
    """data.py and agent_loops.py import it; verl's submodules come only when a function needs them."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    listing = "import sys, generation_core.verl_adapter; print(' '.join(sorted({name.partition('.')[0] for name in sys.modules})))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", listing], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    )
    assert loaded.isdisjoint({"verl", "torch", "ray"})


# ---- the trainer config ----


def test_the_base_trainer_config_is_verls_generated_ppo_trainer():
    path = verl_adapter.base_trainer_config_file()
    assert path.is_file(), (
        f"verl no longer ships {path}: find the generated ppo_trainer config genrun loads its config over"
    )
    config = OmegaConf.load(path)
    assert "rollout" in config.actor_rollout_ref and "max_prompt_length" in config.data


def test_verls_plugin_policy_is_the_one_agent_loops_replays():
    """agent_loops.plugin_entry_points replays what `import verl` loads: VERL_USE_EXTERNAL_PLUGINS
    over the verl.plugins entry-point group."""
    source = Path(verl.__file__).read_text()
    assert 'os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto")' in source
    assert f'group="{PLUGIN_GROUP}"' in source


def test_the_logger_console_quiets_is_verls():
    import importlib.util

    for name in QUIET_AT_ANY_LEVEL:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, (
            f"verl has no module {name} any more (console.QUIET_AT_ANY_LEVEL)"
        )
        assert "getLogger(__name__)" in Path(spec.origin).read_text()


# ---- the agent loop registry ----


def test_the_registry_is_verls_and_holds_its_built_in_loops():
    names = verl_adapter.agent_loop_names()
    assert {"single_turn_agent", "tool_agent"} <= set(names)
    assert verl_adapter._agent_loop_registry() is verl_agent_loop._agent_loop_registry


def test_registering_writes_what_run_agent_loop_reads():
    @verl_agent_loop.register("genrun_pinned_loop")
    class PinnedLoop(verl_agent_loop.AgentLoopBase):
        async def run(self, sampling_params, **kwargs):
            raise NotImplementedError

    try:
        assert verl_adapter.agent_loop_entry("genrun_pinned_loop") == {
            "_target_": f"{__name__}.{PinnedLoop.__qualname__}"
        }
        entry = OmegaConf.create({"name": "genrun_pinned_yaml", "_target_": "x.Y"})
        verl_adapter.register_agent_loop("genrun_pinned_yaml", entry)
        assert verl_agent_loop._agent_loop_registry["genrun_pinned_yaml"] is entry
    finally:
        verl_agent_loop._agent_loop_registry.pop("genrun_pinned_loop", None)
        verl_agent_loop._agent_loop_registry.pop("genrun_pinned_yaml", None)
    # verl's worker reads the registry by this name, and registers agent_loop_config_path entries into it.
    assert "_agent_loop_registry[agent_name]" in _source(AgentLoopWorker._run_agent_loop)
    assert "_agent_loop_registry[agent_loop_config.name] = agent_loop_config" in _source(AgentLoopWorker.__init__)


def test_agent_loop_arguments_are_the_ones_run_agent_loop_passes():
    (instantiate,) = _calls(AgentLoopWorker._run_agent_loop, "instantiate")
    verls = {keyword.arg: ast.unparse(keyword.value) for keyword in instantiate.keywords if keyword.arg != "config"}
    (ours_call,) = _calls(verl_adapter.agent_loop_arguments, "dict")
    ours = {keyword.arg: ast.unparse(keyword.value).replace("worker.", "self.") for keyword in ours_call.keywords}
    assert ours == verls
    # Every attribute read there is one AgentLoopWorker.__init__ sets.
    assert {
        "config",
        "llm_client",
        "tokenizer",
        "processor",
        "hf_model_type",
        "dataset_cls",
        "tools",
        "rollout_config",
    } <= _assigned_self_attributes(AgentLoopWorker.__init__)
    worker = SimpleNamespace(
        config=OmegaConf.create({"data": {"k": 1}}),
        llm_client="c",
        tokenizer="t",
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        tools=["tool"],
    )
    arguments = verl_adapter.agent_loop_arguments(worker)
    assert arguments["trainer_config"].config is worker.config and arguments["data_config"].config == worker.config.data
    assert arguments["tools"].tools == ["tool"]
    # AgentLoopBase takes each of them (tools through its **kwargs).
    parameters = inspect.signature(verl_agent_loop.AgentLoopBase.__init__).parameters
    assert set(arguments) - {"tools"} <= set(parameters) and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def test_verls_own_agent_loops_keep_no_sample_state_on_themselves():
    """Issue 46 item 1: the shard copies one built SingleTurnAgentLoop / ToolAgentLoop per sample
    (verl_adapter.keeps_no_sample_state) instead of running the constructor again; that holds only
    while no method of theirs, or of AgentLoopBase, assigns to the instance outside a constructor."""
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    for agent_class in (SingleTurnAgentLoop, ToolAgentLoop, verl_agent_loop.AgentLoopBase):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(agent_class)))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name == "__init__":
                continue
            method = ast.Module(body=[node], type_ignores=[])
            assigned = [
                target
                for inner in ast.walk(method)
                for target in (
                    inner.targets
                    if isinstance(inner, ast.Assign)
                    else [inner.target]
                    if isinstance(inner, ast.AugAssign | ast.AnnAssign)
                    else []
                )
                if isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ]
            assert not assigned, f"{agent_class.__name__}.{node.name} assigns self.{assigned[0].attr}"
            assert "setattr(self" not in ast.unparse(node), f"{agent_class.__name__}.{node.name} sets an attribute"
    assert verl_adapter.keeps_no_sample_state(SingleTurnAgentLoop)
    assert verl_adapter.keeps_no_sample_state(ToolAgentLoop)
    assert not verl_adapter.keeps_no_sample_state(type("UserLoop", (SingleTurnAgentLoop,), {}))


def test_rebinding_a_worker_client_is_what_its_init_does_with_one():
    source = _source(AgentLoopWorker.__init__)
    assert "self.llm_client = llm_client" in source
    assert (
        'if trace_config.get("token2text", False):' in source and "self.llm_client.tokenizer = self.tokenizer" in source
    )
    worker = SimpleNamespace(
        llm_client=None, tokenizer="tok", rollout_config=SimpleNamespace(trace={"token2text": True})
    )
    client = SimpleNamespace()
    verl_adapter.rebind_worker_client(worker, client)
    assert worker.llm_client is client and client.tokenizer == "tok"


# ---- the shared Continuous Token builder ----


def test_agent_loops_build_their_token_builder_through_the_module_global():
    (call,) = _calls(verl_agent_loop.AgentLoopBase.__init__, "create_continuous_token_builder")
    assert isinstance(call.func, ast.Name), (
        "AgentLoopBase no longer calls the module global create_continuous_token_builder"
    )
    assert {keyword.arg for keyword in call.keywords} == {
        "hf_model_type",
        "chat_template_kwargs",
        "mm_processor_kwargs",
        "processor",
    }


def test_shared_token_builders_are_built_once_per_tokenizer_and_settings(tokenizer):
    verl_adapter.share_continuous_token_builders()
    installed = verl_agent_loop.create_continuous_token_builder
    verl_adapter.share_continuous_token_builders()
    assert verl_agent_loop.create_continuous_token_builder is installed, "installing twice must not wrap twice"
    settings = dict(hf_model_type=None, chat_template_kwargs={}, mm_processor_kwargs={}, processor=None)
    first = installed(tokenizer, **settings)
    assert installed(tokenizer, **settings) is first
    assert installed(tokenizer, **{**settings, "chat_template_kwargs": {"enable_thinking": False}}) is not first


# ---- rollout replicas ----


def test_the_replica_registry_is_a_dict_of_loaders():
    import generation_core.engines.replicas as replicas

    assert isinstance(RolloutReplicaRegistry._registry, dict)
    names = verl_adapter.registered_engine_names()
    assert {"sglang", "vllm", "hf", "instant"} <= set(names)
    for name, replica in replicas.GENRUN_ENGINES.items():
        assert RolloutReplicaRegistry.get(name) is replica


def test_a_standalone_replica_is_recorded_where_the_manager_reads_it():
    assert {"rollout_mode", "servers", "_server_handle", "_server_address"} <= _assigned_self_attributes(
        RolloutReplica.__init__
    )
    initialize = _source(LLMServerManager._initialize_llm_servers)
    assert "server._server_handle for server in self.rollout_replicas" in initialize
    assert "server._server_address for server in self.rollout_replicas" in initialize
    from generation_core.engines.replicas import InstantReplica

    replica = object.__new__(InstantReplica)
    server = object()
    verl_adapter.serve_standalone(replica, server, "genrun_instant_server_0")
    assert replica.server_handle is server and replica.server_address == "genrun_instant_server_0"
    assert replica.rollout_mode is RolloutMode.STANDALONE and replica.servers == [server]


def test_the_manager_starts_its_balancer_after_its_servers():
    create = _source(LLMServerManager.create)
    assert create.index("_initialize_llm_servers()") < create.index("_init_global_load_balancer()")
    assert inspect.iscoroutinefunction(LLMServerManager._init_global_load_balancer)
    assert {"server_handles", "server_addresses"} <= _assigned_self_attributes(LLMServerManager._initialize_llm_servers)
    assert "self.global_load_balancer" in _source(LLMServerManager._init_global_load_balancer)
    started = []
    manager_class = verl_adapter.server_manager_with_registry(lambda servers: started.append(servers) or "balancer")
    assert issubclass(manager_class, LLMServerManager)
    manager = object.__new__(manager_class)
    manager.server_addresses, manager.server_handles = ["a", "b"], ["handle-a", "handle-b"]
    asyncio.run(manager._init_global_load_balancer())
    assert started == [{"a": "handle-a", "b": "handle-b"}] and manager.global_load_balancer == "balancer"


# ---- RLHFDataset over genrun's own rows ----


def _data_config(**changes):
    data = OmegaConf.load(verl_adapter.base_trainer_config_file()).data
    data.update(changes)
    return data


def test_rlhf_dataset_loads_its_files_through_the_hooks_the_adapter_overrides():
    source = _source(RLHFDataset.__init__)
    assert "self._download()" in source and "self._read_files_and_tokenize()" in source
    assert "self.dataframe[item]" in _source(RLHFDataset.__getitem__)
    assert "len(self.dataframe)" in _source(RLHFDataset.__len__)


def test_a_rows_dataset_reads_the_rows_it_is_handed(tokenizer):
    import datasets

    dataset = verl_adapter.rows_dataset(_data_config(), tokenizer)
    assert isinstance(dataset, RLHFDataset)
    rows = datasets.Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "hi"}], "data_source": "d", "extra_info": {"index": 7}}]
    )
    verl_adapter.hand_rows(dataset, rows)
    assert len(dataset) == 1
    assert dataset[0]["raw_prompt"] == [{"role": "user", "content": "hi"}] and dataset[0]["index"] == 7


def test_the_overlong_rule_is_verls_predicate(tokenizer):
    assert list(inspect.signature(RLHFDataset.maybe_filter_out_long_prompts).parameters) == ["self", "dataframe"]
    (filter_call,) = _calls(RLHFDataset.maybe_filter_out_long_prompts, "filter")
    assert [keyword.arg for keyword in filter_call.keywords] == ["num_proc", "desc"]
    short = {"prompt": [{"role": "user", "content": "hi"}]}
    long = {"prompt": [{"role": "user", "content": "hello " * 200}]}
    rule = verl_adapter.overlong_prompt_rule(
        verl_adapter.rows_dataset(_data_config(filter_overlong_prompts=True, max_prompt_length=64), tokenizer)
    )
    assert rule is not None and rule(short) and not rule(long)
    assert (
        verl_adapter.overlong_prompt_rule(
            verl_adapter.rows_dataset(_data_config(filter_overlong_prompts=False), tokenizer)
        )
        is None
    )


def test_prompt_length_settings_are_what_verls_text_doc2len_reads(tokenizer):
    source = _source(RLHFDataset.maybe_filter_out_long_prompts)
    for line in (
        "apply_kwargs = dict(**self.apply_chat_template_kwargs)",
        'apply_kwargs["tools"] = self.tool_schemas',
        'apply_kwargs.pop("tokenize", None)',
        'apply_kwargs.pop("return_dict", None)',
        'apply_kwargs.pop("return_tensors", None)',
        "doc[prompt_key], add_generation_prompt=True, tokenize=True, **apply_kwargs",
        "doc2len(doc) <= self.max_prompt_length",
    ):
        assert line in source, (
            f"verl's doc2len changed: {line!r} is gone (generation_core/inputs/shard_rows.py's _BatchedLengths replays it)"
        )
    data = _data_config(max_prompt_length=99, apply_chat_template_kwargs={"enable_thinking": False, "tokenize": True})
    settings = verl_adapter.prompt_length_settings(verl_adapter.rows_dataset(data, tokenizer))
    assert settings == verl_adapter.PromptLengthSettings(
        prompt_key="prompt", max_prompt_length=99, template_kwargs={"enable_thinking": False}, has_processor=False
    )


# ---- the pickled DataProto ----


def test_a_dataproto_pickles_as_the_state_the_adapter_writes():
    data = DataProto.from_dict(
        tensors={"ids": torch.arange(6).reshape(2, 3)},
        non_tensors={"tag": np.array(["a", "b"], dtype=object)},
        meta_info={"m": 1},
    )
    os.environ.pop("VERL_DATAPROTO_SERIALIZATION_METHOD", None)
    state = data.__getstate__()
    assert isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], bytes)
    assert state[1] is data.non_tensor_batch and state[2] is data.meta_info
    loaded = object.__new__(DataProto)
    loaded.__setstate__(verl_adapter.dataproto_state(state[0], data.non_tensor_batch, data.meta_info))
    assert (
        torch.equal(loaded.batch["ids"], data.batch["ids"])
        and list(loaded.non_tensor_batch["tag"]) == ["a", "b"]
        and loaded.meta_info == {"m": 1}
    )


def test_building_the_rows_dataset_prints_no_tool_schema(model_dir, capsys):
    """Issue 45 item 7: verl's RLHFDataset loads the run's tools, and verl's BaseTool prints each
    schema (18 lines for the tool example) on stdout; genrun's terminal shows its status lines only."""
    from verl.utils import hf_tokenizer

    from generation_core.config.loading import load_config
    from generation_core.verl_adapter import rows_dataset

    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.tool_config_path=examples/tool_calling/tools.yaml"])
    cfg.data.tool_config_path = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    dataset = rows_dataset(cfg.data, hf_tokenizer(str(model_dir)))
    assert dataset.tool_schemas and dataset.tool_schemas[0]["function"]["name"] == "calculator"
    assert capsys.readouterr().out == ""
