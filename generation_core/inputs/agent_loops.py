"""Agent loops and tools, checked before any model loads.

A Ray worker running a shard learns its agent loops from three places: verl's built-in loops
(`single_turn_agent`, `tool_agent`), `verl.plugins` entry points (imported by `import verl` in
every process), and the `agent_loop_config_path` YAML. The driver loads the same three here, so
a mistyped agent name, a plugin that fails to import, a YAML that does not parse, or a tool
config that does not load is refused in seconds, with the list of known names, instead of
failing every shard after the inference replicas have booted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from generation_core.errors import GenrunError
from generation_core.verl_adapter import agent_loop_names, register_agent_loop

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "verl.plugins"


def plugin_entry_points() -> list[EntryPoint]:
    """The `verl.plugins` entry points verl imports in every process (VERL_USE_EXTERNAL_PLUGINS:
    auto, none, or a list of names)."""
    policy = os.getenv("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none":
        return []
    allowed = None if policy == "auto" else {name.strip() for name in policy.split(",") if name.strip()}
    return [
        entry_point
        for entry_point in entry_points(group=PLUGIN_GROUP)
        if allowed is None or entry_point.name in allowed
    ]


def load_plugin_entry_points() -> None:
    """Import every `verl.plugins` entry point verl would import, failing loudly: verl itself logs
    a failed plugin at debug level only, and its agent loops would then silently be missing."""
    for entry_point in plugin_entry_points():
        try:
            entry_point.load()
        except Exception as exc:  # noqa: BLE001 - any import error of user code is reported, not raised
            raise GenrunError(
                f"the {PLUGIN_GROUP} entry point {entry_point.name!r} ({entry_point.value}) fails to import: "
                f"{type(exc).__name__}: {exc}; fix or uninstall the package that declares it"
            ) from None


def existing_config_file(key: str, path: str) -> str:
    """verl's resolution of a config path (absolute, working directory, verl's root), checked."""
    from verl.utils.import_utils import resolve_config_path

    try:
        resolved = resolve_config_path(path)
    except FileNotFoundError:
        resolved = None
    if not resolved or not os.path.isfile(resolved):
        raise GenrunError(f"{key}={path!r} does not exist")
    return resolved


def load_agent_loop_config(path: str) -> list[str]:
    """Register the agent loops of an `agent_loop_config_path` YAML, as verl's AgentLoopWorker
    does, after checking that each entry names an importable class. Returns their names."""
    import hydra

    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    resolved = existing_config_file(key, path)
    try:
        entries = OmegaConf.load(resolved)
    except (OmegaConfBaseException, ValueError, OSError) as exc:
        raise GenrunError(f"{key}={path!r} does not parse as YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(entries, ListConfig):
        raise GenrunError(f"{key}={path!r} must be a YAML list of agent loops, each with name and _target_")
    names = []
    for position, entry in enumerate(entries):
        if not isinstance(entry, DictConfig) or not entry.get("name") or not entry.get("_target_"):
            raise GenrunError(f"{key}={path!r}: entry {position} needs a name and a _target_ (the agent loop class)")
        try:
            hydra.utils.get_class(entry._target_)
        except Exception as exc:  # noqa: BLE001 - hydra wraps import errors of user code in several types
            raise GenrunError(
                f"{key}={path!r}: agent loop {entry.name!r} names {entry._target_!r}, which cannot be imported: {' '.join(str(exc).split())[:300]}"
            ) from None
        register_agent_loop(entry.name, entry)
        names.append(entry.name)
    return names


def known_agent_loops(cfg: DictConfig) -> list[str]:
    """Every agent loop name a shard worker of this run will know."""
    # Importing the package registers verl's built-in loops (single_turn_agent, tool_agent)
    # before any plugin or YAML entry, which may take one of their names.
    import verl.experimental.agent_loop  # noqa: F401

    load_plugin_entry_points()
    config_path = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    if config_path:
        load_agent_loop_config(config_path)
    return agent_loop_names()


def check_agent_loops(cfg: DictConfig, wanted: Iterable[str]) -> None:
    known = known_agent_loops(cfg)
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise GenrunError(
            f"unknown agent loop {unknown[0]!r} (actor_rollout_ref.rollout.agent.default_agent_loop or a row's agent_name); "
            f"registered agent loops: {', '.join(known)}. Register your own with "
            "actor_rollout_ref.rollout.agent.agent_loop_config_path or a verl.plugins entry point"
        )


def check_tools(cfg: DictConfig, agent_names: Iterable[str]) -> int:
    """Load the run's tools once, as every shard worker will; returns how many there are."""
    from verl.tools.tool_registry import load_all_tools

    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    paths = {"tool_config_path": multi_turn.tool_config_path, "function_tool_path": multi_turn.function_tool_path}
    resolved = {}
    for name, path in paths.items():
        resolved[name] = existing_config_file(f"actor_rollout_ref.rollout.multi_turn.{name}", path) if path else None
    if not any(resolved.values()):
        if "tool_agent" in set(agent_names):
            logger.warning("tool_agent runs without tools: set actor_rollout_ref.rollout.multi_turn.tool_config_path")
        return 0
    if resolved["tool_config_path"]:
        _check_tool_modules(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={paths['tool_config_path']!r}",
            resolved["tool_config_path"],
        )
    try:
        # verl's BaseTool prints every schema it builds; a preflight check should not.
        with contextlib.redirect_stdout(io.StringIO()):
            tools = load_all_tools(
                tool_config_path=resolved["tool_config_path"], function_tool_path=resolved["function_tool_path"]
            )
    except Exception as exc:  # noqa: BLE001 - YAML, schema, import and constructor errors of user tools alike
        shown = next(f"{name}={path!r}" for name, path in paths.items() if path)
        raise GenrunError(
            f"tool config actor_rollout_ref.rollout.multi_turn.{shown} does not load: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    return len(tools)


def _check_tool_modules(shown: str, path: str) -> None:
    """Refuse a tool whose `class_name` names a module that cannot be found, naming the class and
    the file (verl's loader fails there with "'NoneType' object has no attribute 'loader'"). A
    file that does not parse is left to verl's loader, whose error the caller reports."""
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(path))
    except Exception:  # noqa: BLE001 - YAML and OmegaConf errors alike: verl's own load, next, reports them
        return
    tools = loaded.get("tools") if isinstance(loaded, dict) else None
    for position, tool in enumerate(tools if isinstance(tools, list) else []):
        class_name = tool.get("class_name") if isinstance(tool, dict) else None
        if not isinstance(class_name, str):
            continue
        module = class_name.rpartition(".")[0]
        try:
            found = bool(module) and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that does not exist, a bad name
            found = False
        if not found:
            where = (
                f"module {module!r} is not found (not installed, nor on PYTHONPATH)" if module else "it names no module"
            )
            raise GenrunError(
                f"tool config {shown}: tools[{position}].class_name={class_name!r} does not load: {where}; "
                "give the class as module.ClassName, its module importable"
            )
