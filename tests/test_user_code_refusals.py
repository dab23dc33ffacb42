"""The user's code a run loads (a tool config's classes, the reward file) refused in one line that
names what the user wrote and where, not the loader's internals (audit 2026-11-28 #18)."""

from __future__ import annotations

import pytest

from generation_core.config.loading import load_config
from generation_core.errors import GenrunError

pytestmark = pytest.mark.timeout(120)

TOOL = """tools:
  - class_name: examples.tool_calling.calculator.CalculatorTool
    config: {type: native}
  - class_name: %s
    config: {type: native}
"""


@pytest.mark.parametrize(
    ("class_name", "why"),
    [
        ("nowhere_at_all.Tool", "module 'nowhere_at_all' is not found (not installed, nor on PYTHONPATH)"),
        ("examples.tool_calling.nowhere.Tool", "module 'examples.tool_calling.nowhere' is not found"),
        ("JustAName", "it names no module"),
    ],
)
def test_a_tool_class_that_does_not_exist_is_named_with_its_file(tmp_path, class_name, why):
    """A class_name whose module does not exist failed with verl's "AttributeError: 'NoneType'
    object has no attribute 'loader'"; the refusal names the tool config file and the class."""
    from generation_core.inputs.agent_loops import check_tools

    tools = tmp_path / "tools.yaml"
    tools.write_text(TOOL % class_name)
    cfg = load_config([f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}"])
    with pytest.raises(GenrunError) as refused:
        check_tools(cfg, ["tool_agent"])
    assert str(refused.value).startswith(
        f"tool config actor_rollout_ref.rollout.multi_turn.tool_config_path={str(tools)!r}: "
        f"tools[1].class_name={class_name!r} does not load: {why}"
    )
    assert str(refused.value).endswith("; give the class as module.ClassName, its module importable")


def test_a_reward_file_with_a_syntax_error_shows_the_error_and_its_line(tmp_path):
    """verl wraps an import error of the reward file in "RuntimeError: Error loading module from
    module_path=..."; the refusal shows the user's own error, a SyntaxError with its line."""
    from generation_core.shard.rewards import load_reward_function

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(**kwargs):\n    return 0.0\n\ndef broken(:\n    pass\n")
    cfg = load_config([f"reward.custom_reward_function.path={reward}"])
    with pytest.raises(GenrunError) as refused:
        load_reward_function(cfg)
    assert str(refused.value) == (
        f"reward.custom_reward_function.path={str(reward)!r} fails to import: SyntaxError: invalid syntax ({reward.name}, line 4)"
    )
