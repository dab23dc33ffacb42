"""The bench's work, the same on both sides: the first rows of the run's dataset as a prompts file
(genrun's side reads it as data.train_files) and as token ids (the engine's side sends them)."""

from __future__ import annotations

from pathlib import Path

from generation_core.errors import GenrunError


def write_prompts(source_files: list[str], out: Path, count: int, prompt_key: str) -> None:
    """The first `count` rows of the run's dataset (cycled when it has fewer), each with its own index."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(source_files[0]).to_pylist()
    if not rows or prompt_key not in rows[0]:
        raise GenrunError(f"{source_files[0]} has no rows with a {prompt_key!r} column to benchmark on")
    chosen = []
    for i in range(count):
        row = dict(rows[i % len(rows)])
        row["extra_info"] = dict(row.get("extra_info") or {}, index=i)
        chosen.append(row)
    pq.write_table(pa.Table.from_pylist(chosen), out)


def prompt_ids(cfg, prompts_file: Path) -> list[list[int]]:
    """The prompts as genrun's agent loop tokenizes them: the chat template, generation prompt added."""
    import pyarrow.parquet as pq

    from generation_core.inputs.tokenizer import run_tokenizer

    tokenizer = run_tokenizer(cfg.actor_rollout_ref.model)
    chats = pq.read_table(prompts_file, columns=[cfg.data.prompt_key]).column(0).to_pylist()
    return [
        list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
        for chat in chats
    ]
