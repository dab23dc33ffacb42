"""Every config value checked before anything starts: a bad one is a one-line error naming the
key, what it must be and (where there is one) the fix, instead of a failure after models loaded."""

from __future__ import annotations

from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from generation_core.config.layout import resolve_layout
from generation_core.config.settings import ROUTING_MODES, HfEngineKwargs
from generation_core.config.verl_keys import REFUSED, SECTIONS, engines_of, is_placed_whole, placement
from generation_core.errors import GenrunError


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise GenrunError(f"invalid {key}={value!r}: {rule}")


def validate_values(cfg: DictConfig) -> None:
    """Reject values that would fail later, after models were loaded and time was spent."""
    _check_counts(cfg)
    _check_sampling(cfg)
    _check_generation(cfg)
    _check_scheduling_and_parts(cfg)
    _check_hf_engine(cfg)
    _check_inputs_and_trackers(cfg)
    resolve_layout(cfg)


def _check_counts(cfg: DictConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    gen = cfg.generation
    for key, value in (
        ("actor_rollout_ref.rollout.n", rollout.n),
        # The data.* lengths first: rollout lengths follow them, and the user usually sets these.
        ("data.max_prompt_length", cfg.data.max_prompt_length),
        ("data.max_response_length", cfg.data.max_response_length),
        ("actor_rollout_ref.rollout.prompt_length", rollout.prompt_length),
        ("actor_rollout_ref.rollout.response_length", rollout.response_length),
        ("generation.num_shards", gen.num_shards),
        ("generation.part_target_bytes", gen.part_target_bytes),
        ("actor_rollout_ref.rollout.max_num_seqs", rollout.max_num_seqs),
        # The replica layout (engines.layout.resolve_layout, below).
        ("trainer.n_gpus_per_node", cfg.trainer.n_gpus_per_node),
        ("trainer.nnodes", cfg.trainer.nnodes),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout.tensor_model_parallel_size),
        ("actor_rollout_ref.rollout.data_parallel_size", rollout.data_parallel_size),
        ("actor_rollout_ref.rollout.pipeline_model_parallel_size", rollout.pipeline_model_parallel_size),
    ):
        _require(
            isinstance(value, int) and not isinstance(value, bool) and value >= 1, key, value, "must be an integer >= 1"
        )


def _check_sampling(cfg: DictConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    _require(
        _is_number(rollout.temperature) and rollout.temperature >= 0,
        "actor_rollout_ref.rollout.temperature",
        rollout.temperature,
        "must be a number >= 0 (0 is greedy)",
    )
    _require(
        _is_number(rollout.top_p) and 0 < rollout.top_p <= 1,
        "actor_rollout_ref.rollout.top_p",
        rollout.top_p,
        "must be in (0, 1]",
    )
    _require(
        isinstance(rollout.top_k, int) and (rollout.top_k == -1 or rollout.top_k >= 1),
        "actor_rollout_ref.rollout.top_k",
        rollout.top_k,
        "must be -1 (off) or >= 1",
    )
    _require(
        isinstance(rollout.calculate_log_probs, bool),
        "actor_rollout_ref.rollout.calculate_log_probs",
        rollout.calculate_log_probs,
        "must be true or false",
    )


def _check_generation(cfg: DictConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    gen = cfg.generation
    _require(
        gen.max_inflight is None
        or (isinstance(gen.max_inflight, int) and not isinstance(gen.max_inflight, bool) and gen.max_inflight >= 1),
        "generation.max_inflight",
        gen.max_inflight,
        "must be null (twice actor_rollout_ref.rollout.max_num_seqs) or an integer >= 1",
    )
    max_open = gen.get("max_open_trajectories")
    _require(
        max_open is None or (isinstance(max_open, int) and not isinstance(max_open, bool) and max_open >= 1),
        "generation.max_open_trajectories",
        max_open,
        "must be null (8 x generation.max_inflight) or an integer >= 1",
    )
    share_cap = gen.get("inflight_share_cap", 8)
    _require(
        isinstance(share_cap, int) and not isinstance(share_cap, bool) and share_cap >= 1,
        "generation.inflight_share_cap",
        share_cap,
        "must be an integer >= 1 (1: each shard keeps its own max_inflight)",
    )
    _require(
        isinstance(gen.retries, int) and gen.retries >= 0, "generation.retries", gen.retries, "must be an integer >= 0"
    )
    _require(
        _is_number(gen.retry_delay_seconds) and gen.retry_delay_seconds >= 0,
        "generation.retry_delay_seconds",
        gen.retry_delay_seconds,
        "must be a number of seconds >= 0",
    )
    _require(
        _is_number(gen.lease_seconds) and gen.lease_seconds >= 4,
        "generation.lease_seconds",
        gen.lease_seconds,
        "must be a number of seconds >= 4",
    )
    _require(
        isinstance(gen.request_retries, int) and not isinstance(gen.request_retries, bool) and gen.request_retries >= 0,
        "generation.request_retries",
        gen.request_retries,
        "must be an integer >= 0",
    )
    _require(
        _is_number(gen.request_backoff_seconds) and gen.request_backoff_seconds >= 0,
        "generation.request_backoff_seconds",
        gen.request_backoff_seconds,
        "must be a number of seconds >= 0",
    )
    _require(
        gen.request_timeout is None or (_is_number(gen.request_timeout) and gen.request_timeout > 0),
        "generation.request_timeout",
        gen.request_timeout,
        "must be null (derived from the response budget) or a number of seconds > 0",
    )
    _require(
        gen.sample_timeout_seconds is None
        or (_is_number(gen.sample_timeout_seconds) and gen.sample_timeout_seconds > 0),
        "generation.sample_timeout_seconds",
        gen.sample_timeout_seconds,
        "must be null (derived from turns, request_retries and request_timeout) or a number of seconds > 0",
    )
    _require(
        _is_number(gen.max_failed_fraction) and 0 <= gen.max_failed_fraction <= 1,
        "generation.max_failed_fraction",
        gen.max_failed_fraction,
        "must be a fraction between 0 and 1",
    )
    _require(
        gen.gpu_hour_price is None or (_is_number(gen.gpu_hour_price) and gen.gpu_hour_price >= 0),
        "generation.gpu_hour_price",
        gen.gpu_hour_price,
        "must be null (no cost figures) or the price of one GPU-hour, a number >= 0 (e.g. 2.5)",
    )
    _require(
        isinstance(gen.recheck_finished_rows, bool),
        "generation.recheck_finished_rows",
        gen.recheck_finished_rows,
        "must be true or false",
    )
    _require(
        isinstance(gen.reward_workers, int) and not isinstance(gen.reward_workers, bool) and gen.reward_workers >= 1,
        "generation.reward_workers",
        gen.reward_workers,
        "must be an integer >= 1",
    )
    _require(
        gen.merge_chunk_size is None
        or (
            isinstance(gen.merge_chunk_size, int)
            and not isinstance(gen.merge_chunk_size, bool)
            and gen.merge_chunk_size >= 1
        ),
        "generation.merge_chunk_size",
        gen.merge_chunk_size,
        "must be null (one trajectories.pkl) or an integer >= 1 (trajectories per chunk file)",
    )
    _require(
        isinstance(gen.merge_max_file_bytes, int)
        and not isinstance(gen.merge_max_file_bytes, bool)
        and gen.merge_max_file_bytes >= 1 << 20,
        "generation.merge_max_file_bytes",
        gen.merge_max_file_bytes,
        "must be an integer number of bytes >= 1048576 (e.g. 4294967296 for 4 GiB)",
    )
    _require(
        gen.sample_seed is None
        or (isinstance(gen.sample_seed, int) and not isinstance(gen.sample_seed, bool) and gen.sample_seed >= 0),
        "generation.sample_seed",
        gen.sample_seed,
        "must be null (no per-sample seeds) or an integer >= 0",
    )
    _require(
        gen.sample_seed is None or rollout.name in SEEDED_ENGINES,
        "generation.sample_seed",
        gen.sample_seed,
        f"needs an engine that honours per-request seeds ({', '.join(SEEDED_ENGINES)}); set it to null for rollout.name={rollout.name}",
    )


def _check_scheduling_and_parts(cfg: DictConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    gen = cfg.generation
    _require(
        gen.routing in ROUTING_MODES, "generation.routing", gen.routing, f"must be one of {', '.join(ROUTING_MODES)}"
    )
    _require(
        not gen.adaptive
        or (
            isinstance(gen.adaptive_k, int) and not isinstance(gen.adaptive_k, bool) and 1 <= gen.adaptive_k < rollout.n
        ),
        "generation.adaptive_k",
        gen.adaptive_k,
        f"must be an integer from 1 to actor_rollout_ref.rollout.n - 1 (n={rollout.n}) with generation.adaptive=true",
    )
    _require(
        gen.save_batch_size is None
        or (
            isinstance(gen.save_batch_size, int)
            and not isinstance(gen.save_batch_size, bool)
            and gen.save_batch_size >= 1
        ),
        "generation.save_batch_size",
        gen.save_batch_size,
        "must be null (parts cut by size and age only) or an integer >= 1 (most trajectories per part)",
    )
    _require(
        _is_number(gen.part_max_seconds) and gen.part_max_seconds > 0,
        "generation.part_max_seconds",
        gen.part_max_seconds,
        "must be a number of seconds > 0",
    )
    first = gen.get("first_part_max_seconds")
    _require(
        first is None or (_is_number(first) and first > 0),
        "generation.first_part_max_seconds",
        first,
        "must be null or a number of seconds > 0",
    )
    _require(
        _is_number(gen.pull_timeout) and gen.pull_timeout > 0,
        "generation.pull_timeout",
        gen.pull_timeout,
        "must be a number of seconds > 0",
    )
    _require(
        _is_number(gen.progress_seconds) and gen.progress_seconds > 0,
        "generation.progress_seconds",
        gen.progress_seconds,
        "must be a number of seconds > 0",
    )
    _require(
        gen.stall_seconds is None or (_is_number(gen.stall_seconds) and gen.stall_seconds > 0),
        "generation.stall_seconds",
        gen.stall_seconds,
        "must be null (a quarter of generation.request_timeout) or a number of seconds > 0",
    )
    _require(
        gen.artifact_mode in ("upload", "reference"),
        "generation.artifact_mode",
        gen.artifact_mode,
        "must be upload or reference",
    )


def _check_hf_engine(cfg: DictConfig) -> None:
    hf = HfEngineKwargs.of(cfg.actor_rollout_ref.rollout.engine_kwargs)
    threads = hf.num_threads
    _require(
        threads is None or (isinstance(threads, int) and threads >= 1),
        "actor_rollout_ref.rollout.engine_kwargs.hf.num_threads",
        threads,
        "must be null or an integer >= 1",
    )
    prefix_bytes = hf.prefix_cache_bytes
    _require(
        prefix_bytes is None
        or (isinstance(prefix_bytes, int) and not isinstance(prefix_bytes, bool) and prefix_bytes >= 0),
        "actor_rollout_ref.rollout.engine_kwargs.hf.prefix_cache_bytes",
        prefix_bytes,
        "must be null (the engine's default) or an integer >= 0 (0: no prefix reuse)",
    )
    later_turns_first = hf.later_turns_first
    _require(
        isinstance(later_turns_first, bool),
        "actor_rollout_ref.rollout.engine_kwargs.hf.later_turns_first",
        later_turns_first,
        "must be true or false",
    )
    shared_prefix = hf.shared_prefix_attention
    _require(
        isinstance(shared_prefix, bool),
        "actor_rollout_ref.rollout.engine_kwargs.hf.shared_prefix_attention",
        shared_prefix,
        "must be true or false",
    )
    weight_first = hf.weight_first_linear
    _require(
        isinstance(weight_first, bool),
        "actor_rollout_ref.rollout.engine_kwargs.hf.weight_first_linear",
        weight_first,
        "must be true or false",
    )


def _check_inputs_and_trackers(cfg: DictConfig) -> None:
    _require(
        isinstance(cfg.data.train_max_samples, int),
        "data.train_max_samples",
        cfg.data.train_max_samples,
        "must be an integer (-1 for all)",
    )
    unknown_loggers = sorted(set(cfg.trainer.logger) - set(_TRACKING_BACKENDS))
    _require(
        not unknown_loggers,
        "trainer.logger",
        list(cfg.trainer.logger),
        f"unknown backend {unknown_loggers[:1]}; known: {', '.join(_TRACKING_BACKENDS)}",
    )
    files = cfg.data.train_files
    _require(
        isinstance(files, str | ListConfig) and len(files) > 0,
        "data.train_files",
        files,
        "must be a path or a list of paths",
    )
    _require(
        isinstance(cfg.data.prompt_key, str) and bool(cfg.data.prompt_key),
        "data.prompt_key",
        cfg.data.prompt_key,
        "must be a column name",
    )
    _require(
        isinstance(cfg.storage.options, DictConfig),
        "storage.options",
        cfg.storage.options,
        "must be a mapping of fsspec options",
    )
    data_options = cfg.data.get("storage_options")
    _require(
        data_options is None or isinstance(data_options, DictConfig),
        "data.storage_options",
        data_options,
        "must be null (use storage.options) or a mapping of fsspec options",
    )


def verl_key_values(cfg: DictConfig) -> dict[str, Any]:
    """Each key under verl_keys.SECTIONS with its value as written, interpolations unresolved: taken
    before and after the overrides, the two tell which keys the user set (`check_verl_keys`). A key
    whose default follows another (rollout.prompt_length from data.max_prompt_length) is unchanged
    until the user sets it itself."""
    values: dict[str, Any] = {}
    for section in SECTIONS:
        node = OmegaConf.select(cfg, section, throw_on_missing=False)
        if isinstance(node, DictConfig):
            _collect_values(node, section, values)
    return values


def _collect_values(node: DictConfig, prefix: str, values: dict[str, Any]) -> None:
    for name in node.keys():
        key = f"{prefix}.{name!s}"
        child = node._get_node(name)
        container = isinstance(child, DictConfig | ListConfig) and not (child._is_none() or child._is_interpolation())
        if container and isinstance(child, DictConfig) and len(child) and not is_placed_whole(key):
            _collect_values(child, key, values)
        elif container:
            # An empty mapping, a list, or a mapping the table places whole (engine_kwargs.sglang).
            values[key] = OmegaConf.to_container(cast(DictConfig | ListConfig, child), resolve=False)
        else:
            values[key] = child._value()  # type: ignore[union-attr]  # a value node: its value as written


def check_verl_keys(cfg: DictConfig, before: dict[str, Any], after: dict[str, Any]) -> None:
    """Refuse every verl key the overrides changed (`before` and `after`: `verl_key_values`) that
    genrun would not act on: one refused by config/verl_keys.py, one only other engines read, or
    one the table does not place (added with `+`)."""
    engine = cfg.actor_rollout_ref.rollout.name
    deleted = object()
    for key in sorted(set(before) | set(after)):
        value = after.get(key, deleted)
        if value == before.get(key, deleted):
            continue
        setting = f"~{key}" if value is deleted else f"{key}={value!r}"
        placed = placement(key)
        if placed is None:
            raise GenrunError(
                f"{setting}: genrun does not know whether this verl key would act in a generation run "
                "(docs/configuration.md, verl keys, lists every key it places); remove it"
            )
        status, reason = placed
        engines = engines_of(status)
        if status == REFUSED:
            raise GenrunError(f"{setting}: {reason}")
        if engines is not None and engine not in engines:
            raise GenrunError(
                f"{setting} acts only with actor_rollout_ref.rollout.name={' or '.join(engines)}, not {engine} "
                f"({reason}); remove it"
            )


# Engines that take a `seed` in each request's sampling parameters (verl's SGLang server does not).
SEEDED_ENGINES = ("hf", "instant", "remote")

_TRACKING_BACKENDS = (
    "console",
    "wandb",
    "mlflow",
    "swanlab",
    "vemlp_wandb",
    "tensorboard",
    "clearml",
    "trackio",
    "file",
)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
