"""Every use of verl's internals, in one place, written against verl 0.9.1.

genrun reaches into verl where verl offers no public door: private registries, private hooks
of classes it subclasses, attributes it sets on verl objects, a function it swaps, the state
verl pickles. Each such reach is one function here, whose docstring names the verl 0.9.1 code
it relies on; the rest of the library calls these functions and touches no underscore name of
verl. tests/test_verl_adapter.py pins every assumption to the installed verl, so an upgrade
fails there, with a message naming what to re-check, and nowhere else.

verl's public API (DataProto, AgentLoopWorker, LLMServerManager and RolloutReplica as classes,
TokenOutput, hf_tokenizer, load_all_tools, ...) is used where it is needed, not through here.
Where genrun mirrors public behaviour of verl, the test beside the mirror compares the two:
tests/test_routing.py (LLMServerClient's call on a replica server, TokenOutput's fields) and
tests/test_merge.py (the padding of AgentLoopWorker's `_postprocess`).

Each function imports the verl module it needs when called: this module is imported by light
and heavy modules alike (data.py, agent_loops.py), and importing it must cost what importing
them cost before (verl.experimental.agent_loop brings Ray, hydra and the tool stack).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datasets
    from verl.experimental.agent_loop import AgentLoopWorker
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.rollout.llm_server import LLMServerManager
    from verl.workers.rollout.replica import RolloutReplica

VERL_VERSION = "0.9.1"
"""The verl this module was written and tested against (tests/test_verl_adapter.py checks it)."""


# ---- the trainer config ----


def base_trainer_config_file() -> Path:
    """verl's generated `ppo_trainer` config, the base genrun's config is loaded over: the file
    verl 0.9.1 ships as `verl/trainer/config/_generated_ppo_trainer.yaml` (a private name).
    Found without importing verl (which imports torch): a typo'd key is refused at once."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("verl is not installed; genrun needs verl==0.9.1 (pip install -e .)")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config" / "_generated_ppo_trainer.yaml"


# ---- the agent loop registry (verl/experimental/agent_loop/agent_loop.py) ----


def _agent_loop_registry() -> dict[str, Any]:
    """verl 0.9.1's module-level `_agent_loop_registry` (name -> hydra config of the loop class),
    which `@register` and `AgentLoopWorker.__init__` (agent_loop_config_path) write and
    `_run_agent_loop` reads. Importing the package first registers verl's built-in loops
    (single_turn_agent, tool_agent)."""
    import verl.experimental.agent_loop  # noqa: F401
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as registry

    return registry


def agent_loop_names() -> list[str]:
    """Every agent loop registered in this process, sorted."""
    return sorted(_agent_loop_registry())


def register_agent_loop(name: str, entry: Any) -> None:
    """Register one `agent_loop_config_path` entry (a DictConfig with `_target_`) under `name`,
    as AgentLoopWorker.__init__ does with each entry of that YAML."""
    _agent_loop_registry()[name] = entry


def agent_loop_entry(name: str) -> Any:
    """The registry entry `_run_agent_loop` would instantiate for `name` (KeyError: unknown)."""
    return _agent_loop_registry()[name]


def agent_loop_arguments(worker: AgentLoopWorker) -> dict[str, Any]:
    """The keyword arguments verl 0.9.1's `AgentLoopWorker._run_agent_loop` passes to
    `hydra.utils.instantiate` for each sample's agent loop, read from the worker's attributes
    (config, llm_client, tokenizer, processor, hf_model_type, dataset_cls, tools) and wrapped in
    its DictConfigWrap / ToolListWrap so hydra does not resolve them."""
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap

    return dict(
        trainer_config=DictConfigWrap(config=worker.config),
        server_manager=worker.llm_client,
        tokenizer=worker.tokenizer,
        processor=worker.processor,
        hf_model_type=worker.hf_model_type,
        dataset_cls=worker.dataset_cls,
        data_config=DictConfigWrap(worker.config.data),
        tools=ToolListWrap(worker.tools),
    )


def keeps_no_sample_state(agent_class: type) -> bool:
    """Whether instances of `agent_class` hold nothing of one sample: verl 0.9.1's own
    SingleTurnAgentLoop and ToolAgentLoop set attributes only in their constructors, from the
    worker's config, tokenizer and tools (a trajectory's state lives in `run`'s locals and
    ToolAgentLoop's AgentData). A copy of one built for an earlier sample is then the agent loop
    a fresh construction gives, without the constructor's OmegaConf reads (about ten per sample).
    A subclass, or any other loop, may keep a sample's state on itself: not these."""
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

    return agent_class in (SingleTurnAgentLoop, ToolAgentLoop)


def rebind_worker_client(worker: AgentLoopWorker, client: Any) -> None:
    """Give an AgentLoopWorker built earlier a new llm client: what verl 0.9.1's
    `AgentLoopWorker.__init__` does with its `llm_client` argument (stores it as `llm_client`,
    and hands the client its tokenizer when `rollout.trace.token2text` is on)."""
    worker.llm_client = client
    if worker.rollout_config.trace.get("token2text", False):
        client.tokenizer = worker.tokenizer


# ---- one Continuous Token builder per tokenizer (verl's AgentLoopBase.__init__) ----

_token_builders: dict[tuple, Any] = {}


def share_continuous_token_builders() -> None:
    """Make every agent loop built with the same tokenizer and settings share one Continuous
    Token builder. verl 0.9.1's `AgentLoopBase.__init__` calls the module global
    `create_continuous_token_builder` of verl/experimental/agent_loop/agent_loop.py (imported
    there from verl.utils.tokenizer.continuous_token_wiring) in every agent loop's constructor:
    ~1 ms per sample, plus a warning per sample for a model family without its own builder. A
    builder only reads the tokenizer and the settings it was made with (its state is set in
    `__init__`), so that global is replaced by a caching wrapper. Idempotent."""
    import verl.experimental.agent_loop.agent_loop as verl_agent_loop

    current = verl_agent_loop.create_continuous_token_builder
    if getattr(current, "_genrun_shares", False):
        return
    verl_agent_loop.create_continuous_token_builder = _caching_builder(current)


def _caching_builder(create: Callable[..., Any]) -> Callable[..., Any]:
    def shared_token_builder(tokenizer, **kwargs):
        try:
            key = (
                id(tokenizer),
                id(kwargs.get("processor")),
                repr(sorted((k, v) for k, v in kwargs.items() if k != "processor")),
            )
        except Exception:  # noqa: BLE001 - settings without a stable repr: build one as verl would
            return create(tokenizer, **kwargs)
        if key not in _token_builders:
            # The tokenizer is kept with its builder so that its id is not reused by another.
            _token_builders[key] = (tokenizer, create(tokenizer, **kwargs))
        return _token_builders[key][1]

    shared_token_builder._genrun_shares = True  # type: ignore[attr-defined]  # the mark that makes installing idempotent
    return shared_token_builder


# ---- rollout replicas (verl/workers/rollout/replica.py, verl/workers/rollout/llm_server.py) ----


def registered_engine_names() -> list[str]:
    """The rollout names verl can boot: the keys of verl 0.9.1's private
    `RolloutReplicaRegistry._registry` (its `get` only raises on an unknown name)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    return list(RolloutReplicaRegistry._registry)


def register_replica_class(name: str, replica: type[RolloutReplica]) -> None:
    """Register a replica class under a rollout name: `RolloutReplicaRegistry.register` takes a
    function that returns the class (verl 0.9.1 imports engines lazily that way)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(name, lambda: replica)


def serve_standalone(replica: RolloutReplica, server: Any, address: str) -> None:
    """Record a replica's one server actor as verl 0.9.1's `RolloutReplica.init_standalone`
    leaves it: `rollout_mode` STANDALONE, `servers`, and the private `_server_handle` /
    `_server_address` that `LLMServerManager._initialize_llm_servers` reads from every replica."""
    from verl.workers.rollout.replica import RolloutMode

    replica.rollout_mode = RolloutMode.STANDALONE
    replica._server_handle = server
    replica._server_address = address
    replica.servers = [server]


def server_manager_with_registry(start_registry: Callable[[dict[str, Any]], Any]) -> type[LLMServerManager]:
    """An LLMServerManager whose load balancer (verl's name for it) is `start_registry(servers)` (server address ->
    server actor handle) instead of verl's router actor. verl 0.9.1's `LLMServerManager.create`
    calls the private `_init_global_load_balancer` after `_initialize_llm_servers` has set
    `server_addresses` and `server_handles`; its result is kept as `global_load_balancer`."""
    from verl.workers.rollout.llm_server import LLMServerManager

    class ManagerWithOwnBalancer(LLMServerManager):
        async def _init_global_load_balancer(self) -> None:
            servers = dict(zip(self.server_addresses, self.server_handles, strict=True))
            self.global_load_balancer = start_registry(servers)

    return ManagerWithOwnBalancer


# ---- RLHFDataset over rows genrun reads itself (verl/utils/dataset/rl_dataset.py) ----


def rows_dataset(
    data_config: Any, tokenizer: Any, processor: Any = None, read_images: Callable | None = None
) -> RLHFDataset:
    """verl's RLHFDataset with its own settings (tool schemas, chat-template kwargs, filter
    switches, all as its __init__ reads them from data.*) but without loading files: rows are
    handed to it with `hand_rows`. The private hooks it overrides, `_download` and
    `_read_files_and_tokenize`, are the ones verl 0.9.1's `__init__` calls to load files and the
    ones verl's custom dataset classes override, so its filter and `__getitem__` stay verl's."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    base = RLHFDataset if read_images is None else vision_dataset_class(read_images)

    class RowsDataset(base):  # type: ignore[misc, valid-type]
        def _download(self, use_origin_parquet=False):
            pass

        def _read_files_and_tokenize(self):
            pass

    # Its __init__ loads the run's tools (data.tool_config_path), whose verl BaseTool prints every
    # schema it builds on stdout: the terminal shows a run's status lines, not tool schemas.
    with contextlib.redirect_stdout(io.StringIO()):
        return RowsDataset([], tokenizer, data_config, processor=processor, max_samples=-1)


def hand_rows(dataset: RLHFDataset, rows: datasets.Dataset) -> None:
    """Give a `rows_dataset` its rows: verl 0.9.1's RLHFDataset reads `self.dataframe` in
    `__len__` and `__getitem__` (`_read_files_and_tokenize` would have set it)."""
    dataset.dataframe = rows


class _PredicateCatcher:
    """Stands in for the `datasets.Dataset` verl's `maybe_filter_out_long_prompts` calls
    `.filter(predicate, num_proc=..., desc=...)` on, to take the predicate instead of running it
    over every row (`datasets.Dataset.filter` also hashes the predicate, which holds the
    tokenizer: ~1.2 s)."""

    predicate = None

    def filter(self, predicate, num_proc=None, desc=None):
        self.predicate = predicate
        return self

    def __len__(self) -> int:
        return 0


def overlong_prompt_rule(dataset: RLHFDataset) -> Callable[[dict], bool] | None:
    """verl's overlong-prompt predicate of `dataset` (`doc2len(doc) <= max_prompt_length`, true
    for a row it keeps), or None when it filters nothing. verl 0.9.1's
    `RLHFDataset.maybe_filter_out_long_prompts(dataframe)` returns its argument untouched when
    `filter_overlong_prompts` is off, and otherwise calls `dataframe.filter(predicate, ...)` and
    prints the length of what that returned."""
    import contextlib
    import io

    catcher = _PredicateCatcher()
    # verl prints the length of what its filter returned: meaningless here.
    with contextlib.redirect_stdout(io.StringIO()):
        dataset.maybe_filter_out_long_prompts(catcher)
    return catcher.predicate


@dataclass(frozen=True)
class PromptLengthSettings:
    """What verl's text-only `doc2len` measures a prompt with."""

    prompt_key: str
    """The row's column of chat messages (data.prompt_key)."""
    max_prompt_length: int
    """The longest prompt kept, in tokens (data.max_prompt_length)."""
    template_kwargs: dict[str, Any]
    """Keyword arguments of `apply_chat_template` besides the messages and add_generation_prompt."""
    has_processor: bool
    """A multimodal processor measures prompts its own way (verl's other doc2len)."""


def prompt_length_settings(dataset: RLHFDataset) -> PromptLengthSettings:
    """The settings verl 0.9.1's text-only `doc2len` (in `maybe_filter_out_long_prompts`) reads
    from the dataset: `prompt_key`, `max_prompt_length`, the chat template kwargs
    (`apply_chat_template_kwargs`, plus `tools=tool_schemas` when the dataset has tool schemas,
    less `tokenize`, `return_dict` and `return_tensors`, which it sets itself), `processor`."""
    kwargs = dict(dataset.apply_chat_template_kwargs)
    if dataset.tool_schemas is not None:
        kwargs["tools"] = dataset.tool_schemas
    for key in ("tokenize", "return_dict", "return_tensors"):
        kwargs.pop(key, None)
    return PromptLengthSettings(
        prompt_key=dataset.prompt_key,
        max_prompt_length=dataset.max_prompt_length,
        template_kwargs=kwargs,
        has_processor=dataset.processor is not None,
    )


# ---- the pickled DataProto (verl/protocol.py) ----


def dataproto_state(
    batch_bytes: bytes, non_tensor_batch: dict[str, Any], meta_info: dict[str, Any]
) -> tuple[bytes, dict[str, Any], dict[str, Any]]:
    """The state a pickled DataProto carries: verl 0.9.1's `DataProto.__getstate__` returns
    (torch.save bytes of the TensorDict batch, non_tensor_batch, meta_info) and `__setstate__`
    reads that tuple back (unless VERL_DATAPROTO_SERIALIZATION_METHOD=numpy, which genrun's
    files never use)."""
    return batch_bytes, non_tensor_batch, meta_info


# ---- images (verl/utils/dataset/rl_dataset.py, verl/experimental/agent_loop/agent_loop.py) ----


def vision_dataset_class(read_images: Callable, base: type | None = None) -> type:
    """`base` (verl's RLHFDataset by default) with `read_images(messages, image_patch_size)` ->
    (images, videos) (genrun's: inputs/images.vision_info) in
    place of qwen_vl_utils, which imports torchvision: verl 0.9.1's agent loops call the dataset
    class's `process_multi_modal_info`, which runs the private classmethod
    `_process_multi_modal_info(messages, image_patch_size, config)` -> (images, videos, audios),
    and so does its overlong filter's `doc2len` with a processor."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    base = base or RLHFDataset

    class GenrunVisionDataset(base):  # type: ignore[misc, valid-type]
        @classmethod
        def _process_multi_modal_info(cls, messages, image_patch_size, config):
            images, videos = read_images(messages, image_patch_size)
            return images, videos, cls._extract_audio_info(messages)

    return GenrunVisionDataset


def equip_worker_for_images(worker: AgentLoopWorker, processor: Any, read_images: Callable) -> None:
    """Give an AgentLoopWorker the run's processor (verl 0.9.1's `__init__` sets `processor` from
    `HFModelConfig.processor`, None here for a VL folder) and genrun's image reader on its
    `dataset_cls` (a user's `data.custom_cls` keeps its own `_process_multi_modal_info`)."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    worker.processor = processor
    if worker.dataset_cls is RLHFDataset or "_process_multi_modal_info" not in vars(worker.dataset_cls):
        worker.dataset_cls = vision_dataset_class(read_images, worker.dataset_cls)


def multimodal_postprocess(
    processor: Any, tokenizer: Any, input_ids: Any, attention_mask: Any, images: list[Any], data_config: Any = None
) -> tuple[dict[str, Any], Any]:
    """(multi_modal_inputs, position_ids) of one padded trajectory, by verl 0.9.1's own
    `AgentLoopWorker._compute_multi_modal_inputs(output, input_ids)` and
    `_compute_position_ids(input_ids, attention_mask, multi_modal_inputs, mm_processor_kwargs)`
    (private), which read `processor`, `tokenizer` and `_get_mm_processor_kwargs` (from
    `data.mm_processor_kwargs`) of the worker; `input_ids` and `attention_mask` are (1, seq)."""
    from types import SimpleNamespace

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    kwargs = dict((data_config or {}).get("mm_processor_kwargs") or {})
    worker = SimpleNamespace(processor=processor, tokenizer=tokenizer, _get_mm_processor_kwargs=lambda audios: kwargs)
    output = SimpleNamespace(multi_modal_data={"images": images} if images else {}, mm_processor_kwargs=None)
    inputs = AgentLoopWorker._compute_multi_modal_inputs(worker, output, input_ids)  # type: ignore[arg-type]
    positions = AgentLoopWorker._compute_position_ids(worker, input_ids, attention_mask, inputs, None)  # type: ignore[arg-type]
    return inputs, positions
