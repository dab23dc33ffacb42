"""Every config value checked before anything starts: a bad one is a one-line error naming the
key, what it must be and (where there is one) the fix, instead of a failure after models loaded.

genrun's own settings (`generation:`, `engine_kwargs.hf`) check themselves as they are built
(config/settings.py, config/engine_kwargs.py); here are the checks of verl's keys, of what
depends on the engine, and of the verl keys a user may not set (config/verl_keys.py)."""

from __future__ import annotations

from typing import Any, cast

from omegaconf import DictConfig, ListConfig, OmegaConf

from generation_core.config.checks import is_number, section_of
from generation_core.config.layout import resolve_layout
from generation_core.config.settings import DECLARED, GenerationSettings
from generation_core.config.verl_keys import REFUSED, SECTIONS, engines_of, is_placed_whole, placement
from generation_core.errors import GenrunError


def _require(ok: bool, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise GenrunError(f"invalid {key}={value!r}: {rule}")


def validate_values(cfg: DictConfig) -> None:
    """Reject values that would fail later, after models were loaded and time was spent."""
    _check_counts(cfg)
    _check_sampling(cfg)
    _check_settings(cfg)
    _check_inputs_and_trackers(cfg)
    resolve_layout(cfg)


def _check_counts(cfg: DictConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    for key, value in (
        ("actor_rollout_ref.rollout.n", rollout.n),
        # The data.* lengths first: rollout lengths follow them, and the user usually sets these.
        ("data.max_prompt_length", cfg.data.max_prompt_length),
        ("data.max_response_length", cfg.data.max_response_length),
        ("actor_rollout_ref.rollout.prompt_length", rollout.prompt_length),
        ("actor_rollout_ref.rollout.response_length", rollout.response_length),
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
        is_number(rollout.temperature) and rollout.temperature >= 0,
        "actor_rollout_ref.rollout.temperature",
        rollout.temperature,
        "must be a number >= 0 (0 is greedy)",
    )
    _require(
        is_number(rollout.top_p) and 0 < rollout.top_p <= 1,
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


def _check_settings(cfg: DictConfig) -> None:
    """genrun's own settings check themselves as they are built (settings.py, engine_kwargs.py);
    what also depends on the engine is checked here."""
    rollout = cfg.actor_rollout_ref.rollout
    for section, cls in DECLARED.items():  # every declared key against its rule
        cls(**section_of(OmegaConf.select(cfg, section), cls))
    settings = GenerationSettings.of(cfg)
    _require(
        settings.sample_seed is None or rollout.name in SEEDED_ENGINES,
        "generation.sample_seed",
        settings.sample_seed,
        f"needs an engine that honours per-request seeds ({', '.join(SEEDED_ENGINES)}); set it to null for "
        f"rollout.name={rollout.name}",
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
