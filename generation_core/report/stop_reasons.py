"""Why each response stopped, derived from its record (engines' stop reasons are not stored).

A last model token that is an end-of-sequence id is `eos`; a response that filled its budget is
`length`; one that ends on tool or user tokens, `tool_turn` (verl's tool loop stopped after a
tool answer filled the budget or hit a turn limit); a model turn count at
`multi_turn.max_assistant_turns`, `turn_limit`; anything else (a stop string, an engine that
stopped without EOS), `no_eos`. Vectorised over a part table: the report reads every part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from generation_core.store.run_record import RunRecord

STOP_REASONS = {
    "eos": "end of sequence (EOS)",
    "length": "length limit (rollout.response_length)",
    "tool_turn": "ended on tool/user tokens",
    "turn_limit": "assistant-turn limit (multi_turn.max_assistant_turns)",
    "no_eos": "no EOS (stop string or engine)",
}
"""Why a response stopped, as the report names it; the codes are indices into this order."""
_STOP_CODES = {name: code for code, name in enumerate(STOP_REASONS)}


@dataclass(frozen=True)
class Limits:
    """What decides a stop reason, from run.json's config and the tokenizer."""

    prompt_length: int
    response_length: int
    max_assistant_turns: int | None
    eos_token_ids: frozenset[int]

    @classmethod
    def of_run(cls, run: RunRecord, eos_token_ids: frozenset[int]) -> Limits:
        rollout = run.rollout
        turns = (rollout.get("multi_turn") or {}).get("max_assistant_turns")
        return cls(
            int(rollout["prompt_length"]), int(rollout["response_length"]), int(turns) if turns else None, eos_token_ids
        )


def _list_layout(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flattened values, start of each row in them, each row's length) of a list column."""
    lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False)
    starts = np.cumsum(lengths) - lengths
    return values, starts, lengths


def _row_sums(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    total = np.concatenate([[0], np.cumsum(values, dtype=np.int64)])
    return total[starts + lengths] - total[starts]


def stop_reasons(table: pa.Table, limits: Limits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stop code, response tokens, model tokens) of each row of a part table."""
    ids, starts, lengths = _list_layout(table.column("response_ids"))
    mask = pc.list_flatten(table.column("response_mask")).to_numpy(zero_copy_only=False).astype(np.int8)
    prompt_lengths = pc.list_value_length(table.column("prompt_ids")).to_numpy(zero_copy_only=False)
    model_tokens = _row_sums(mask, starts, lengths)
    # Model turns: runs of mask 1, each starting at a row's first token or after a 0.
    row_start = np.zeros(len(mask), dtype=bool)
    row_start[starts[lengths > 0]] = True
    previous = np.concatenate([[0], mask[:-1]])
    turn_starts = ((mask == 1) & (row_start | (previous != 1))).astype(np.int8)
    model_turns = _row_sums(turn_starts, starts, lengths)

    nonempty = lengths > 0
    last = np.where(nonempty, starts + lengths - 1, 0)
    last_id = np.where(nonempty, ids[last] if len(ids) else 0, -1)
    last_mask = np.where(nonempty, mask[last] if len(mask) else 0, -1)
    is_eos = np.isin(last_id, list(limits.eos_token_ids)) & (last_mask == 1)
    full = (lengths >= limits.response_length) | (
        prompt_lengths + lengths >= limits.prompt_length + limits.response_length
    )
    turn_limit = (
        model_turns >= limits.max_assistant_turns if limits.max_assistant_turns else np.zeros(len(lengths), dtype=bool)
    )
    code = np.select(
        [is_eos, full, last_mask == 0, turn_limit],
        [_STOP_CODES["eos"], _STOP_CODES["length"], _STOP_CODES["tool_turn"], _STOP_CODES["turn_limit"]],
        default=_STOP_CODES["no_eos"],
    )
    return code.astype(np.int8), lengths, model_tokens
