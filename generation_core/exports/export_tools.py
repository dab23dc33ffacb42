"""The tool schemas an export row carries: the run's tools as verl's ToolAgentLoop rendered
them into its prompts, narrowed to the ones a row's `extra_info.tool_selection` offered.

Read from run.json's tool config; the tool classes it names are code, built only when the user
passes --trust-remote-code (reading a run folder never runs code from it otherwise)."""

from __future__ import annotations

import contextlib
import io
from typing import Any, cast

from generation_core.errors import GenrunError
from generation_core.inputs.agent_loops import existing_config_file


def run_tool_schemas(config: dict[str, Any], trust_remote_code: bool = False) -> list[dict[str, Any]] | None:
    """The run's tool schemas as verl's ToolAgentLoop renders them into prompts, or None when
    the run had no tool config. The tool classes (code run.json names) are built only with the
    user's --trust-remote-code; otherwise the schemas come from the tool config's `tool_schema`
    entries, as verl validates them, and a tool whose schema only its code knows is refused."""
    multi_turn = config["actor_rollout_ref"]["rollout"].get("multi_turn") or {}
    paths = {name: multi_turn.get(name) for name in ("tool_config_path", "function_tool_path")}
    if not any(paths.values()):
        return None
    resolved = {
        name: existing_config_file(f"actor_rollout_ref.rollout.multi_turn.{name}", path) if path else None
        for name, path in paths.items()
    }
    if not trust_remote_code:
        return declared_tool_schemas(resolved)
    from verl.tools.tool_registry import load_all_tools

    try:
        # verl's BaseTool prints every schema it builds.
        with contextlib.redirect_stdout(io.StringIO()):
            tools = load_all_tools(
                tool_config_path=resolved["tool_config_path"], function_tool_path=resolved["function_tool_path"]
            )
    except Exception as exc:  # noqa: BLE001 - YAML, schema, import and constructor errors of user tools alike
        raise GenrunError(
            f"the run's tool config ({paths}) does not load here: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    return [tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in tools] or None


def declared_tool_schemas(paths: dict[str, str | None]) -> list[dict[str, Any]] | None:
    """The schemas a tool config declares, read without importing a tool class."""
    from omegaconf import DictConfig, OmegaConf
    from verl.tools.schemas import OpenAIFunctionToolSchema

    needs_code = f"function_tool_path={paths['function_tool_path']}" if paths["function_tool_path"] else None
    declared = (
        (cast(DictConfig, OmegaConf.load(paths["tool_config_path"])).get("tools") or [])
        if paths["tool_config_path"]
        else []
    )
    schemas = []
    for tool in declared:
        if tool.get("tool_schema") is None:
            needs_code = needs_code or f"{tool.get('class_name')} in {paths['tool_config_path']} (no tool_schema)"
            continue
        schemas.append(
            OpenAIFunctionToolSchema.model_validate(OmegaConf.to_container(tool.tool_schema, resolve=True)).model_dump(
                exclude_unset=True, exclude_none=True
            )
        )
    if needs_code:
        raise GenrunError(
            f"the run's tool schemas come from code ({needs_code}), which genrun export runs only when asked: add --trust-remote-code if you trust it"
        )
    return schemas or None


def selected_tools(tools: list[dict[str, Any]], input_fields: dict[str, Any]) -> list[dict[str, Any]]:
    # verl's ToolAgentLoop offers a row only the tools its extra_info.tool_selection names.
    selection = (input_fields.get("extra_info") or {}).get("tool_selection")
    if not selection:
        return tools
    return [tool for tool in tools if tool.get("function", {}).get("name") in set(selection)]
