"""Reward for the arithmetic example, in verl's custom_reward_function convention.

`reward.custom_reward_function.path=examples/tool_calling/reward.py` (name: compute_score):
1.0 when the last number in the model's text equals the ground truth, else 0.0. The dict's
other keys become columns of the merged DataProto (verl's reward_extra_info).
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    numbers = _NUMBER.findall(solution_str.split("</tool_call>")[-1])
    answered = numbers[-1] if numbers else None
    correct = answered is not None and float(answered) == float(ground_truth)
    return {"score": 1.0 if correct else 0.0, "answered": answered is not None}
