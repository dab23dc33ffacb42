"""Write the tool-calling example dataset (data/arithmetic.parquet) in verl's chat layout.

Run `python examples/tool_calling/make_dataset.py` to regenerate; the file is committed. Each row
asks one arithmetic question, carries its answer as `reward_model.ground_truth` (read by
reward.py), and names its agent loop in `agent_name` (verl's per-row selection), so the example
runs tool_agent without changing the run's default agent loop.

The system prompt describes the calculator and hermes' `<tool_call>` format in words because
the bundled model's chat template does not render a `tools` list, and one worked exchange
(question, tool call, tool result, answer) precedes the question: a 135M model copies a
demonstrated format far more often than it follows a description.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).resolve().parent / "data" / "arithmetic.parquet"
SYSTEM = (
    "You can use a calculator. To use it, reply with exactly\n"
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "<arithmetic expression>"}}\n</tool_call>\n'
    "and wait for the result. Then give the final answer as a number."
)

DEMONSTRATION = [
    {"role": "user", "content": "What is (15 + 27) * 2?"},
    {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "calculator", "arguments": {"expression": "(15 + 27) * 2"}}\n</tool_call>',
    },
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "The answer is 84."},
]


def make_rows(count: int = 24, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        op = rng.choice(["+", "-", "*"])
        expression = f"({a} {op} {b}) * {c}"
        answer = eval(expression)  # noqa: S307 - our own literal expression
        rows.append(
            {
                "data_source": "genrun/arithmetic",
                "agent_name": "tool_agent",
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    *DEMONSTRATION,
                    {"role": "user", "content": f"What is {expression}?"},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {"split": "example", "index": index, "expression": expression},
            }
        )
    return rows


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(make_rows()), OUT)
    print(f"wrote {OUT}: {json.dumps(make_rows()[0])[:200]}...")
