"""Write the bundled demo prompts (generation_core/config/demo_prompts.parquet, package data) in verl's chat format.

Run `python infra/make_prompts.py` to regenerate; the file is committed so a fresh clone has it.
Rows follow verl's RLHF parquet layout: data_source, prompt (chat messages), ability,
reward_model {style, ground_truth}, extra_info {split, index}.
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INSTRUCTIONS = [
    "Name three primary colors.",
    "What is the capital of France?",
    "Give one tip for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain what a noun is in one sentence.",
    "What does a thermometer measure?",
    "Suggest a name for a friendly robot.",
    "List two fruits that are red.",
    "Why do leaves change color in autumn?",
    "Translate 'good morning' into Spanish.",
    "What is the opposite of 'hot'?",
    "Describe a cat in five words.",
    "What is the largest planet in our solar system?",
    "Give an example of a renewable energy source.",
    "What do bees make?",
    "Write one sentence about friendship.",
    "How many days are in a week?",
    "What is water made of?",
    "Name a musical instrument with strings.",
    "What should you do before crossing a street?",
    "Give a synonym for 'happy'.",
    "What season comes after winter?",
    "Why is exercise good for you?",
    "Name an animal that lives in the ocean.",
]
MATH = [(a, b) for a, b in [(2, 3), (7, 5), (12, 9), (15, 27), (8, 8), (21, 13), (34, 11), (9, 6), (45, 55), (17, 4), (6, 7), (30, 12)]]


def rows():
    index = 0
    for text in INSTRUCTIONS:
        yield {
            "data_source": "genrun/instructions",
            "prompt": [{"role": "user", "content": text}],
            "ability": "chat",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "demo", "index": index},
        }
        index += 1
    for a, b in MATH:
        for op, result in (("+", a + b), ("*", a * b)):
            yield {
                "data_source": "genrun/arithmetic",
                "prompt": [
                    {"role": "system", "content": "You are a careful math tutor. Answer briefly."},
                    {"role": "user", "content": f"What is {a} {op} {b}?"},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(result)},
                "extra_info": {"split": "demo", "index": index},
            }
            index += 1


def main() -> None:
    out = Path(__file__).resolve().parent.parent / "generation_core" / "config" / "demo_prompts.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(list(rows()))
    pq.write_table(table, out)
    print(f"wrote {table.num_rows} prompts to {out}")


if __name__ == "__main__":
    main()
