"""Load, override and validate the run configuration (its fingerprint: generation_core/preflight/fingerprint.py).

The base is verl's own generated `ppo_trainer` config, so every verl key a user knows keeps its
meaning and verl's AgentLoopWorker finds everything it reads; `genrun.yaml` beside this file
sets generation defaults and adds the `generation.*` and `storage.*` sections. Overrides use
Hydra's syntax; an unknown key is an error naming the closest valid key, and so is a key added
with `+` where nothing would read it (FREE_FORM_SECTIONS).
"""

from __future__ import annotations

import dataclasses
import difflib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import hydra.utils
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from generation_core.config import bundled
from generation_core.config.engine_kwargs import hf_device
from generation_core.config.settings import declared_defaults
from generation_core.config.validation import check_verl_keys, validate_values, verl_key_values
from generation_core.errors import GenrunError
from generation_core.secrets import PLACEHOLDER, masked_paths, unreadable_override_holds_secret, without_url_credentials
from generation_core.verl_adapter import base_trainer_config_file

VERL_BASE_CONFIG = base_trainer_config_file()
GENRUN_DEFAULTS = Path(__file__).parent / "genrun.yaml"


def _scheduled_date() -> str:
    """The scheduled date of the Prefect flow run this config belongs to (UTC), else today's:
    a nightly deployment names its output folder after the night it stands for, even when it
    starts late or is retried the next day."""
    try:
        from prefect.runtime import flow_run

        scheduled = flow_run.scheduled_start_time
    except ImportError:
        scheduled = None
    if scheduled is None:
        return datetime.now(UTC).strftime("%Y-%m-%d")
    return scheduled.astimezone(UTC).strftime("%Y-%m-%d")


# Mappings that pass through to another library, which owns their keys.
OPEN_MAPPINGS = ("storage.options", "data.storage_options", "ray_kwargs.ray_init")

# Where a key added with `+` is read although the defaults do not list it: OPEN_MAPPINGS, these
# sections (free-form by design: an engine's own kwargs, the reward function's kwargs, verl's
# extension point for custom agent-loop settings), a mapping that is empty in the defaults
# (apply_chat_template_kwargs, override_config, engine_kwargs.sglang, ...), a field of the verl
# dataclass a section's `_target_` names, and ADDED_DATA_KEYS. Anywhere else nothing reads an
# added key: `+generation.num_shard=4` would run one shard, so it is refused.
FREE_FORM_SECTIONS = (
    "actor_rollout_ref.rollout.engine_kwargs",
    "reward.custom_reward_function.reward_kwargs",
    "custom_reward_function.reward_kwargs",
    "actor_rollout_ref.rollout.custom",
)
# genrun's own engines read exactly the keys their settings classes declare (config/engine_kwargs.py).
CLOSED_SECTIONS = tuple(f"actor_rollout_ref.rollout.engine_kwargs.{engine}" for engine in ("hf", "remote", "instant"))
# data.* keys verl's RLHFDataset (which each shard builds) reads with a default, absent from the defaults.
ADDED_DATA_KEYS = ("data.cache_dir", "data.chat_template_func", "data.filter_prompts", "data.need_tools_kwargs")

_BUNDLED = {
    "bundled_prompts": lambda: str(bundled.BUNDLED_PROMPTS),
    "bundled_model": lambda: str(bundled.bundled_model_dir()),
    "scheduled_date": _scheduled_date,
}


def _genrun_resolver(name: str) -> str:
    if name not in _BUNDLED:
        raise GenrunError(f"unknown ${{genrun:{name}}}; known: {', '.join(sorted(_BUNDLED))}")
    return _BUNDLED[name]()


OmegaConf.register_new_resolver("genrun", _genrun_resolver, replace=True)


def load_config(overrides: list[str] | tuple[str, ...] | None = ()) -> DictConfig:
    """Defaults + Hydra-style overrides -> a resolved, validated config (no fingerprint yet)."""
    overrides = () if overrides is None else overrides
    _check_override_list(overrides)
    cfg = default_config()
    known_keys = _flat_keys(cfg)
    verl_defaults = verl_key_values(cfg)
    for override in _parse_overrides(list(overrides)):
        _apply_override(cfg, override, known_keys)
    verl_settings = verl_key_values(cfg)
    try:
        # Resolve once: per-sample interpolation in verl's agent loop costs a third of its time.
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as exc:
        raise GenrunError(f"config does not resolve: {exc}".splitlines()[0]) from None
    _refuse_masked_secrets(cfg)
    _route_legacy_keys(cfg)
    validate_values(cfg)
    # After the values' own checks (whose messages say more), before anything starts: a verl key
    # the user set that genrun would not act on is refused (config/verl_keys.py).
    check_verl_keys(cfg, verl_defaults, verl_settings)
    # The settings other settings decide (max_inflight, the deadlines) stay as the user wrote them:
    # GenerationSettings.of decides them in every process that reads this config.
    return cfg


def default_config() -> DictConfig:
    """The defaults before any override: verl's ppo_trainer config, genrun.yaml over it, and the
    sections genrun declares key by key (settings.DECLARED) over both."""
    return cast(
        DictConfig,
        OmegaConf.merge(
            OmegaConf.load(VERL_BASE_CONFIG), OmegaConf.load(GENRUN_DEFAULTS), OmegaConf.create(declared_defaults())
        ),
    )


def _refuse_masked_secrets(cfg: DictConfig) -> None:
    """Overrides copied from a stored run (its Prefect parameters, run.json) hold the placeholder
    where a secret was: refused, rather than sent to a server or bucket as the secret."""
    masked = masked_paths(OmegaConf.to_container(cfg))
    if masked:
        raise GenrunError(
            f"{', '.join(masked)}: {PLACEHOLDER} is the mask genrun stores in place of a secret, not a value; "
            f"give the secret itself, from the environment: {masked[0]}='${{oc.env:NAME}}'"
        )


def _route_legacy_keys(cfg: DictConfig) -> None:
    """Keys verl users know from older configs, moved to where verl 0.9.1's agent loop reads them."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    data_tools = cfg.data.get("tool_config_path")
    if data_tools and multi_turn.tool_config_path and data_tools != multi_turn.tool_config_path:
        raise GenrunError(
            f"data.tool_config_path={data_tools!r} and actor_rollout_ref.rollout.multi_turn.tool_config_path="
            f"{multi_turn.tool_config_path!r} disagree; set only one of them"
        )
    if data_tools and not multi_turn.tool_config_path:
        multi_turn.tool_config_path = data_tools
    # The top-level custom_reward_function of older verl configs; verl 0.9.1 reads reward.*.
    legacy_reward = cfg.get("custom_reward_function") or {}
    if legacy_reward.get("path") and not cfg.reward.custom_reward_function.path:
        cfg.reward.custom_reward_function.path = legacy_reward["path"]
        if legacy_reward.get("name"):
            cfg.reward.custom_reward_function.name = legacy_reward["name"]
        if legacy_reward.get("reward_kwargs") is not None:
            cfg.reward.custom_reward_function.reward_kwargs = legacy_reward["reward_kwargs"]
    # verl's trainers run tool_agent when multi_turn is enabled; keep that meaning here, unless
    # the user chose another agent loop.
    agent = cfg.actor_rollout_ref.rollout.agent
    if multi_turn.enable and agent.default_agent_loop == "single_turn_agent":
        agent.default_agent_loop = "tool_agent"
    # The transformers engine runs in a replica actor that sees only the rollout config: its
    # device is decided here, once (trainer.device is verl's key for it).
    hf_kwargs = cfg.actor_rollout_ref.rollout.engine_kwargs.get("hf")
    if hf_kwargs is not None:
        hf_kwargs.device = hf_device(hf_kwargs.get("device"), cfg.trainer.get("device"))


def _check_override_list(overrides: Any) -> None:
    """Overrides come from the CLI, Python callers and Prefect deployment parameters; a YAML
    slip there (a string, a number, a mapping) must be refused with the fix, not split into
    characters or crash in Hydra's parser."""
    how = "in prefect.yaml write parameters: {overrides: ['data.train_files=...', 'generation.num_shards=4']}"
    if isinstance(overrides, str | bytes) or not isinstance(overrides, list | tuple | ListConfig):
        raise GenrunError(
            f"overrides must be a list of 'key=value' strings, got {type(overrides).__name__} {overrides!r:.80}; {how}"
        )
    for position, item in enumerate(overrides):
        if not isinstance(item, str):
            raise GenrunError(
                f"overrides[{position}] must be a 'key=value' string, got {type(item).__name__} {item!r:.80}; "
                f"quote it as one string, e.g. 'generation.num_shards=4'; {how}"
            )


def _parse_overrides(overrides: list[str]):
    for text in overrides:
        if "=" not in text and not text.startswith("~"):
            raise GenrunError(f"cannot read override {text!r}: write key=value, e.g. generation.num_shards=4")
    parser, parsed = OverridesParser.create(), []
    for text in overrides:  # one at a time: a refusal names the override it is about
        try:
            parsed.append(parser.parse_override(text))
        except HydraException as exc:
            raise GenrunError(_unparsed(text, str(exc).splitlines()[0])) from None
    return parsed


def _unparsed(text: str, reason: str) -> str:
    """The refusal of an override Hydra cannot read. Hydra's reason quotes the input around the
    error: where that may hold a secret (secrets.py's rule), the override is named by its key alone."""
    how = "close its brackets and braces, or quote a value holding them (or commas, = or spaces): key='value'"
    if unreadable_override_holds_secret(text):
        key = text.partition("=")[0]
        return f"cannot parse override {key}={PLACEHOLDER} (a secret: its value is not shown); {how}"
    return without_url_credentials(f"cannot parse override {text!r}: {reason}; {how}")


def _apply_override(cfg: DictConfig, override, known_keys: list[str]) -> None:
    key = override.key_or_group
    if override.is_delete():
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or leaf not in node:
            raise GenrunError(f"cannot delete {key!r}: no such key{_suggest(key, known_keys)}")
        del node[leaf]
        return
    added = override.is_add() or override.is_force_add()
    if not added and key not in known_keys and not _in_open_dict(cfg, key):
        raise GenrunError(f"unknown config key {key!r}{_suggest(key, known_keys)} (prefix with + to add a new key)")
    if added and key not in known_keys and not _in_open_dict(cfg, key) and not _read_when_added(cfg, key):
        raise GenrunError(
            f"+{key}: no such config key, and nothing would read it (keys are added only under storage.options, data.storage_options, "
            "ray_kwargs.ray_init, actor_rollout_ref.rollout.engine_kwargs.<engine>, reward.custom_reward_function.reward_kwargs, "
            f"actor_rollout_ref.rollout.custom){_suggest(key, known_keys, leaf_cutoff=0.6, alternatives=2)}"
        )
    value = override.value()
    try:
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    except OmegaConfBaseException as exc:
        raise GenrunError(f"cannot set {key}={value!r}: {str(exc).splitlines()[0]}") from None


def _in_open_dict(cfg: DictConfig, key: str) -> bool:
    """True for a new key under a mapping that is free-form by design (`storage.options`,
    `engine_kwargs`, ...): such mappings are empty in the defaults."""
    if any(key.startswith(mapping + ".") for mapping in OPEN_MAPPINGS):
        return True  # at any depth (ray_init.runtime_env.env_vars.X), also while it is null (data.storage_options)
    parts = key.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        node = OmegaConf.select(cfg, ".".join(parts[:depth]), throw_on_missing=False)
        if isinstance(node, DictConfig):
            return len(node) == 0
    return False


def _read_when_added(cfg: DictConfig, key: str) -> bool:
    """True for a key added with `+` that something reads (FREE_FORM_SECTIONS says where)."""
    if key in ADDED_DATA_KEYS:
        return True
    if any(key.startswith(section + ".") for section in CLOSED_SECTIONS):
        return False
    if any(key == section or key.startswith(section + ".") for section in FREE_FORM_SECTIONS):
        return True
    # A field verl's dataclass for the section has but its generated YAML leaves out
    # (e.g. actor_rollout_ref.rollout.enable_sleep_mode): verl reads it. Whether genrun acts on
    # it is config/verl_keys.py's to say (check_verl_keys).
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if parent else None
    if isinstance(node, DictConfig) and isinstance(node.get("_target_"), str):
        try:
            target = hydra.utils.get_class(node._target_)
        except Exception:  # noqa: BLE001 - hydra wraps import errors in several types; then nothing is known
            return False
        return dataclasses.is_dataclass(target) and leaf in {f.name for f in dataclasses.fields(target)}
    return False


# Sections a user sets, preferred when a name matches keys in several (e.g. tiled_mlp.num_shards).
_USER_SECTIONS = (
    "generation.",
    "data.",
    "trainer.",
    "actor_rollout_ref.rollout.",
    "actor_rollout_ref.model.",
    "reward.",
    "storage.",
)


def _user_rank(key: str) -> tuple[int, int]:
    """Lower for the key a user more likely means: an earlier _USER_SECTIONS entry, then the shorter."""
    section = next((rank for rank, prefix in enumerate(_USER_SECTIONS) if key.startswith(prefix)), len(_USER_SECTIONS))
    return section, len(key)


def _suggest(key: str, known_keys: list[str], leaf_cutoff: float = 0.75, alternatives: int = 1) -> str:
    parent, _, leaf = key.rpartition(".")
    if parent in known_keys:
        # A new name in a section that exists: the closest of that section's keys, by name (the
        # whole key would match the section itself, or any sibling by their shared prefix).
        siblings = [known.rpartition(".")[2] for known in known_keys if known.rpartition(".")[0] == parent]
        close = [f"{parent}.{name}" for name in difflib.get_close_matches(leaf, siblings, n=alternatives, cutoff=0.6)]
        # Another section's key only by (nearly) its own name: the key was put in the wrong section.
        leaf_cutoff = max(leaf_cutoff, 0.85)
    else:
        close = difflib.get_close_matches(key, known_keys, n=1, cutoff=0.6)
    if not close:
        by_leaf: dict[str, str] = {}
        for known in sorted(known_keys, key=_user_rank, reverse=True):
            by_leaf[known.rsplit(".", 1)[-1]] = known
        leaf_match = difflib.get_close_matches(leaf, list(by_leaf), n=alternatives, cutoff=leaf_cutoff)
        close = [by_leaf[match] for match in leaf_match]
    return f"; did you mean {' or '.join(repr(k) for k in close)}?" if close else ""


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    if isinstance(node, DictConfig):
        for k in node.keys():
            path = f"{prefix}{k!s}"
            keys.append(path)
            child = node._get_node(k)
            if isinstance(child, DictConfig):
                keys.extend(_flat_keys(child, path + "."))
    return keys


def train_files(cfg: DictConfig) -> list[str]:
    files = cfg.data.train_files
    return [files] if isinstance(files, str) else list(files)


def finalize_run_location(cfg: DictConfig, run_fingerprint: str) -> None:
    """Fill the experiment name and output folder the user left to us (derived from the
    fingerprint, so running the same command again resumes)."""
    if cfg.trainer.experiment_name in (None, ""):
        cfg.trainer.experiment_name = f"gen-{run_fingerprint[:12]}"
    if cfg.trainer.default_local_dir in (None, ""):
        cfg.trainer.default_local_dir = str(Path("outputs") / cfg.trainer.project_name / cfg.trainer.experiment_name)
