"""Every verl key that could shape what is generated, placed: honoured, refused, or irrelevant.

genrun's config is verl's own `ppo_trainer` config, so a user can set any of verl's keys; a key
genrun accepted but never read would change nothing without a word (`reward_model.enable=true`
gave no model scores). VERL_KEYS places each leaf of the sections that shape generation
(SECTIONS: verl's generated tree, genrun's additions there, and the fields verl's dataclasses
take with `+`), keyed by dotted key or by a pattern (`*` spans dots; an exact key wins over a
pattern, a longer pattern over a shorter one), one line per key (the formatter is off there), as
(status, reason):

- HONOURED: genrun, or the verl code a run calls (RLHFDataset, the agent loops, verl's replicas),
  reads it and acts on it;
- `honoured by <engines>` (`honoured_by`): only those engines (rollout.name) read it; with any
  other engine a value the user set is refused;
- REFUSED: a value the user set (a key an override changed) is refused in one line, before any
  model loads; the reason says what to do instead;
- IRRELEVANT: it does not change what a generation run produces; the reason says why.

config/validation.py (`check_verl_keys`) applies it to the keys the overrides changed;
docs/configuration.md (verl keys) shows the same table, and tests/test_verl_keys.py holds the
page, this table and the installed verl's tree to one another.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

HONOURED = "honoured"
REFUSED = "refused"
IRRELEVANT = "irrelevant"
_BY = "honoured by "


def honoured_by(*engines: str) -> str:
    """The status of a key only these engines (actor_rollout_ref.rollout.name) read."""
    return _BY + ", ".join(engines)


def engines_of(status: str) -> tuple[str, ...] | None:
    """The engines an `honoured_by` status names; None for any other status."""
    return tuple(status[len(_BY) :].split(", ")) if status.startswith(_BY) else None


SECTIONS = ("data", "actor_rollout_ref.rollout", "reward", "reward_model", "custom_reward_function")
"""The config sections whose keys can change what verl generates."""

SGLANG_VLLM = honoured_by("sglang", "vllm")
VLLM = honoured_by("vllm")

_MULTIMODAL = (
    "genrun reads images from verl's default `images` column for a vision-language model (docs/multimodal.md); "
    "other multimodal columns and settings are not supported yet"
)
_TRAINER_BATCHES = "a training step's batch; genrun generates every row once, in generation.num_shards shards"
_VALIDATION = (
    "a trainer's validation set or sampling; a genrun run generates data.train_files with the rollout's sampling "
    "settings"
)
_UNREAD = "verl 0.9.1 never acts on it"
_WEIGHT_SYNC = (
    "moving a trainer's weights into the engine between training steps; genrun's engines load "
    "actor_rollout_ref.model.path"
)
_SLEEP = "a trainer's sleep and wake of the engine between steps; genrun's replicas serve for the whole run"
_TRAINER_LOGPROBS = "a trainer recomputing log-probs; genrun keeps the engine's own (calculate_log_probs)"
_OBSERVABILITY = "observability (profiling, metrics, logs): nothing generated changes"
_REWARD_MODEL = (
    "verl's reward model served as rollout replicas of its own (its reward loop) is not supported; score with "
    "reward.custom_reward_function (a function may call a judge model itself)"
)
_SEED = "for reproducible sampling set generation.sample_seed (each sample's requests seeded)"
_TP_DP = "sglang/vllm: GPUs per replica (tp x dp x pp); genrun's own engines have no model parallelism"

# fmt: off
VERL_KEYS: dict[str, tuple[str, str]] = {
    # ---- data ----
    "data.train_files": (HONOURED, "the prompts (inputs/dataset_files.py)"),
    "data.prompt_key": (HONOURED, "the column of chat messages"),
    "data.train_max_samples": (HONOURED, "the first N rows (-1: all)"),
    "data.max_prompt_length": (HONOURED, "the rollout's prompt_length: the overlong filter and the DataProto's prompt width"),
    "data.max_response_length": (HONOURED, "the rollout's response_length: each response's budget and the DataProto's width"),
    "data.filter_overlong_prompts": (HONOURED, "verl's overlong filter, applied by each shard to its rows (skipped prompts counted)"),
    "data.apply_chat_template_kwargs": (HONOURED, "passed to the chat template by the agent loops and the overlong filter"),
    "data.tool_config_path": (HONOURED, "verl's older place for multi_turn.tool_config_path (copied there)"),
    "data.train_tasks": (HONOURED, "genrun's tasks instead of a preprocessing script"),
    "data.task_cache_dir": (HONOURED, "where built tasks are cached"),
    "data.storage_options": (HONOURED, "fsspec options of the input files"),
    "data.function_tool_path": (REFUSED, "set actor_rollout_ref.rollout.multi_turn.function_tool_path, the key the agent loops read"),
    "data.reward_fn_key": (REFUSED, "genrun passes the data_source column to the reward function; name your column data_source"),
    "data.shuffle": (REFUSED, "genrun generates every row (data.train_max_samples: the first N) and the output is in index order; shuffle the file to sample rows"),
    "data.custom_cls.*": (REFUSED, "genrun reads rows with verl's RLHFDataset, not a dataset class of yours; build rows with data.train_tasks (a Task's build_row)"),
    "data.image_key": (REFUSED, _MULTIMODAL),
    "data.video_key": (REFUSED, _MULTIMODAL),
    "data.audio_key": (REFUSED, _MULTIMODAL),
    "data.image_patch_size": (REFUSED, _MULTIMODAL),
    "data.mm_processor_kwargs": (REFUSED, _MULTIMODAL),
    "data.return_multi_modal_inputs": (IRRELEVANT, _UNREAD),
    "data.seed": (IRRELEVANT, "verl uses it only to shuffle (data.shuffle, refused)"),
    "data.tokenizer": (IRRELEVANT, f"{_UNREAD}; the tokenizer is actor_rollout_ref.model.tokenizer_path's, else model.path's"),
    "data.trust_remote_code": (IRRELEVANT, "verl's PPO trainer and genrun follow actor_rollout_ref.model.trust_remote_code"),
    "data.use_shm": (IRRELEVANT, "how verl copies input files locally; genrun reads data.train_files through fsspec"),
    "data.cache_dir": (IRRELEVANT, "where verl copies input files; genrun reads data.train_files through fsspec"),
    "data.val_files": (IRRELEVANT, _VALIDATION),
    "data.val_max_samples": (IRRELEVANT, _VALIDATION),
    "data.val_batch_size": (IRRELEVANT, _VALIDATION),
    "data.validation_shuffle": (IRRELEVANT, _VALIDATION),
    "data.train_batch_size": (IRRELEVANT, _TRAINER_BATCHES),
    "data.gen_batch_size": (IRRELEVANT, _TRAINER_BATCHES),
    "data.dataloader_num_workers": (IRRELEVANT, "a trainer's data loader; each shard reads its own rows"),
    "data.filter_overlong_prompts_workers": (IRRELEVANT, "processes of verl's up-front filter; each shard filters its rows as it dispatches them"),
    "data.return_raw_input_ids": (IRRELEVANT, _UNREAD),
    "data.return_raw_chat": (IRRELEVANT, f"{_UNREAD}: the agent loops always take the raw chat"),
    "data.return_full_prompt": (IRRELEVANT, _UNREAD),
    "data.truncation": (IRRELEVANT, f"{_UNREAD}: overlong prompts are filtered (filter_overlong_prompts) or left-truncated by the agent loop"),
    "data.chat_template_func": (IRRELEVANT, _UNREAD),
    "data.filter_prompts": (IRRELEVANT, _UNREAD),
    "data.need_tools_kwargs": (IRRELEVANT, "only a warning when a row has no tools_kwargs"),
    # ---- the rollout: engine and sampling ----
    "*._target_": (REFUSED, "the verl class a section is built as; genrun is written against verl's own"),
    "actor_rollout_ref.rollout.name": (HONOURED, "the engine (docs/engines.md)"),
    "actor_rollout_ref.rollout.temperature": (HONOURED, "sent with every request"),
    "actor_rollout_ref.rollout.top_p": (HONOURED, "sent with every request"),
    "actor_rollout_ref.rollout.top_k": (HONOURED, "sent with every request"),
    "actor_rollout_ref.rollout.calculate_log_probs": (HONOURED, "sent with every request; rollout_log_probs in the output"),
    "actor_rollout_ref.rollout.ignore_eos": (HONOURED, "sent with every request"),
    "actor_rollout_ref.rollout.n": (HONOURED, "trajectories per prompt"),
    "actor_rollout_ref.rollout.prompt_length": (HONOURED, "the engines' prompt limit and the DataProto's prompt width (from data.max_prompt_length)"),
    "actor_rollout_ref.rollout.response_length": (HONOURED, "each response's budget and the DataProto's width (from data.max_response_length)"),
    "actor_rollout_ref.rollout.max_num_seqs": (HONOURED, "the engine's decode batch, and generation.max_inflight's default"),
    "actor_rollout_ref.rollout.do_sample": (REFUSED, "verl's agent loops never act on it; for greedy decoding set actor_rollout_ref.rollout.temperature=0"),
    "actor_rollout_ref.rollout.repetition_penalty": (REFUSED, "every request carries repetition_penalty 1.0, as verl's agent loop sends it"),
    "actor_rollout_ref.rollout.over_sample_rate": (IRRELEVANT, f"{_UNREAD} (it would drop a step's slowest requests); genrun generates every sample"),
    "actor_rollout_ref.rollout.full_determinism": (REFUSED, f"verl's batch-invariant, deterministic routing is not supported; {_SEED}"),
    "actor_rollout_ref.rollout.seed": (VLLM, f"vLLM's engine seed; {_SEED}"),
    "actor_rollout_ref.rollout.mode": (REFUSED, "genrun serves async replicas only (verl 0.9.1 has no other mode)"),
    "actor_rollout_ref.rollout.nnodes": (REFUSED, "set trainer.nnodes: genrun lays out the replicas from trainer.nnodes and trainer.n_gpus_per_node"),
    "actor_rollout_ref.rollout.n_gpus_per_node": (REFUSED, "set trainer.n_gpus_per_node: genrun lays out the replicas from the trainer's counts"),
    "actor_rollout_ref.rollout.router_config_path": (REFUSED, "genrun routes requests itself (generation.routing), not through verl's router"),
    "actor_rollout_ref.rollout.limit_images": (REFUSED, _MULTIMODAL),
    "actor_rollout_ref.rollout.moe_tensor_parallel_size": (REFUSED, "TensorRT-LLM's; genrun has no TensorRT-LLM engine"),
    "actor_rollout_ref.rollout.engine_kwargs.trtllm": (REFUSED, "TensorRT-LLM's; genrun has no TensorRT-LLM engine"),
    "actor_rollout_ref.rollout.disaggregation.*": (REFUSED, "prefill/decode-disaggregated replicas are not supported: genrun sends each request to one replica's server"),
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class": (REFUSED, "genrun drives verl's agent loops itself, shard by shard, without a manager"),
    # ---- the rollout: what verl's own servers read ----
    "actor_rollout_ref.rollout.dtype": (SGLANG_VLLM, "the server's weight dtype; the hf engine's is engine_kwargs.hf.dtype"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": (SGLANG_VLLM, "the share of each GPU the server takes"),
    "actor_rollout_ref.rollout.load_format": (SGLANG_VLLM, "how the server reads model.path (dummy, random weights, is refused)"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (SGLANG_VLLM, _TP_DP),
    "actor_rollout_ref.rollout.data_parallel_size": (SGLANG_VLLM, _TP_DP),
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": (SGLANG_VLLM, _TP_DP),
    "actor_rollout_ref.rollout.expert_parallel_size": (SGLANG_VLLM, "the server's expert parallelism (MoE models)"),
    "actor_rollout_ref.rollout.enforce_eager": (SGLANG_VLLM, "the server runs without CUDA graphs"),
    "actor_rollout_ref.rollout.max_model_len": (SGLANG_VLLM, "the server's context length"),
    "actor_rollout_ref.rollout.quantization": (SGLANG_VLLM, "the server's weight quantization"),
    "actor_rollout_ref.rollout.mtp": (SGLANG_VLLM, "the server's multi-token-prediction (speculative) decoding"),
    "actor_rollout_ref.rollout.engine_kwargs.sglang": (honoured_by("sglang"), "passed to verl's SGLang server untouched"),
    "actor_rollout_ref.rollout.engine_kwargs.vllm": (VLLM, "passed to verl's vLLM server untouched"),
    "actor_rollout_ref.rollout.max_num_batched_tokens": (honoured_by("hf", "vllm"), "tokens one engine step may run"),
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": (VLLM, "the batch sizes vLLM captures CUDA graphs for"),
    "actor_rollout_ref.rollout.enable_chunked_prefill": (VLLM, "vLLM's chunked prefill"),
    "actor_rollout_ref.rollout.enable_prefix_caching": (VLLM, "vLLM's prefix cache (the hf engine's: engine_kwargs.hf.prefix_cache_bytes)"),
    "actor_rollout_ref.rollout.logprobs_mode": (VLLM, "which log-probs vLLM returns (before or after sampling processors)"),
    "actor_rollout_ref.rollout.scheduling_policy": (VLLM, "vLLM's request scheduling"),
    "actor_rollout_ref.rollout.quantization_config_file": (VLLM, "vLLM's quantization config"),
    # ---- the rollout: genrun's own engines and your own code ----
    "actor_rollout_ref.rollout.engine_kwargs.hf.*": (HONOURED, "genrun's transformers engine (rollout.name=hf)"),
    "actor_rollout_ref.rollout.engine_kwargs.instant.*": (HONOURED, "genrun's test and benchmark engine (rollout.name=instant)"),
    "actor_rollout_ref.rollout.engine_kwargs.remote.*": (HONOURED, "servers that already run (rollout.name=remote)"),
    "actor_rollout_ref.rollout.engine_kwargs.*": (HONOURED, "the settings of an engine of your own, read by the engine of that name"),
    "actor_rollout_ref.rollout.custom": (HONOURED, "settings your own agent loops read (verl's extension point)"),
    # ---- the rollout: agent loops and tools ----
    "actor_rollout_ref.rollout.agent.default_agent_loop": (HONOURED, "the agent loop of rows without an agent_name"),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": (HONOURED, "a YAML registering your own agent loops"),
    "actor_rollout_ref.rollout.agent.num_workers": (IRRELEVANT, "verl's agent-loop workers; in genrun each shard task is one"),
    "actor_rollout_ref.rollout.agent.custom_async_server.*": (IRRELEVANT, _UNREAD),
    "actor_rollout_ref.rollout.multi_turn.enable": (HONOURED, "tool calling (tool_agent unless you chose another loop)"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": (HONOURED, "the tools the agent loops load"),
    "actor_rollout_ref.rollout.multi_turn.function_tool_path": (HONOURED, "Python functions the agent loops load as tools"),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": (HONOURED, "read by tool_agent; also the default sample deadline's turns"),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": (HONOURED, "read by tool_agent"),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": (HONOURED, "read by tool_agent"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": (HONOURED, "read by tool_agent"),
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": (HONOURED, "read by tool_agent"),
    "actor_rollout_ref.rollout.multi_turn.format": (HONOURED, "the tool-call parser tool_agent uses"),
    "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template": (IRRELEVANT, _UNREAD),
    "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode": (IRRELEVANT, _UNREAD),
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts": (IRRELEVANT, _UNREAD),
    # ---- the rollout: a trainer's, or nothing generated changes ----
    "actor_rollout_ref.rollout.val_kwargs.*": (IRRELEVANT, _VALIDATION),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": (IRRELEVANT, _TRAINER_LOGPROBS),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (IRRELEVANT, _TRAINER_LOGPROBS),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": (IRRELEVANT, _TRAINER_LOGPROBS),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": (IRRELEVANT, _TRAINER_LOGPROBS),
    "actor_rollout_ref.rollout.layered_summon": (IRRELEVANT, _WEIGHT_SYNC),
    "actor_rollout_ref.rollout.checkpoint_engine.*": (IRRELEVANT, _WEIGHT_SYNC),
    "actor_rollout_ref.rollout.checkpoint_manager_class": (IRRELEVANT, _WEIGHT_SYNC),
    "actor_rollout_ref.rollout.layer_name_map": (IRRELEVANT, _WEIGHT_SYNC),
    "actor_rollout_ref.rollout.qat": (IRRELEVANT, "a trainer's quantization-aware training"),
    "actor_rollout_ref.rollout.free_cache_engine": (IRRELEVANT, _SLEEP),
    "actor_rollout_ref.rollout.multi_stage_wake_up": (IRRELEVANT, _SLEEP),
    "actor_rollout_ref.rollout.enable_sleep_mode": (IRRELEVANT, _SLEEP),
    "actor_rollout_ref.rollout.standalone_gpu_memory_utilization": (IRRELEVANT, "verl's fully-async trainer's; genrun's servers take gpu_memory_utilization"),
    "actor_rollout_ref.rollout.sglang_engine_mode": (IRRELEVANT, _UNREAD),
    "actor_rollout_ref.rollout.server": (IRRELEVANT, "TensorRT-LLM's HTTP client; genrun has no TensorRT-LLM engine"),
    "actor_rollout_ref.rollout.skip_tokenizer_init": (IRRELEVANT, "whether SGLang loads a tokenizer; genrun sends and receives token ids either way"),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": (IRRELEVANT, "records MoE expert routing for a trainer; the tokens are the same"),
    "actor_rollout_ref.rollout.moe_load_balance_metrics_interval": (IRRELEVANT, _OBSERVABILITY),
    "actor_rollout_ref.rollout.disable_log_stats": (IRRELEVANT, _OBSERVABILITY),
    "actor_rollout_ref.rollout.profiler.*": (IRRELEVANT, _OBSERVABILITY),
    "actor_rollout_ref.rollout.prometheus.*": (IRRELEVANT, _OBSERVABILITY),
    "actor_rollout_ref.rollout.trace.*": (IRRELEVANT, f"{_OBSERVABILITY} (verl's rollout trace, set up by each shard's agent-loop worker)"),
    # ---- rewards ----
    "reward.custom_reward_function.path": (HONOURED, "your reward function's file"),
    "reward.custom_reward_function.name": (HONOURED, "its name (compute_score)"),
    "reward.custom_reward_function.reward_kwargs": (HONOURED, "keyword arguments it is called with"),
    "reward.num_workers": (IRRELEVANT, "verl's reward-loop workers; genrun scores in generation.reward_workers threads"),
    "reward.reward_manager.*": (REFUSED, "genrun scores each trajectory as verl's naive reward manager does (reward.custom_reward_function, else verl's scorer by data_source); other managers are not supported"),
    "reward.reward_model.*": (REFUSED, _REWARD_MODEL),
    "reward.sandbox_fusion.*": (REFUSED, "genrun does not call verl's code sandbox (verl's code data sources stay unscored); call your sandbox from reward.custom_reward_function"),
    # verl's older top-level sections (verl 0.9.1 moves them under reward.*).
    "custom_reward_function.path": (HONOURED, "verl's older reward.custom_reward_function.path (copied there)"),
    "custom_reward_function.name": (HONOURED, "verl's older reward.custom_reward_function.name (copied there)"),
    "custom_reward_function.reward_kwargs": (HONOURED, "verl's older reward.custom_reward_function.reward_kwargs (copied there)"),
    "reward_model.*": (REFUSED, f"verl's older reward section: {_REWARD_MODEL}"),
}
# fmt: on


def _is_pattern(key: str) -> bool:
    return "*" in key


_PATTERNS = sorted((key for key in VERL_KEYS if _is_pattern(key)), key=len, reverse=True)


def placement(key: str) -> tuple[str, str] | None:
    """(status, reason) of a dotted key: its own entry, else the longest pattern it matches; None
    where VERL_KEYS does not place it."""
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    pattern = next((pattern for pattern in _PATTERNS if fnmatchcase(key, pattern)), None)
    return None if pattern is None else VERL_KEYS[pattern]


def is_placed_whole(key: str) -> bool:
    """True for a key VERL_KEYS names itself: a mapping there (engine_kwargs.sglang, the chat
    template's kwargs) is placed as one value, whatever keys it holds."""
    return key in VERL_KEYS
