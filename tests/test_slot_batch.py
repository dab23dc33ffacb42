"""The slot store of the transformers engine, without a model: what compaction moves and keeps."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from generation_core.engines.hf.slot_batch import KVShape, SlotBatch

pytestmark = pytest.mark.timeout(60)

SHAPE = KVShape(layers=2, heads=2, head_dim=4, dtype=torch.float32, device="cpu")


@dataclass(eq=False)
class _Seq:
    name: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)


def _batch_with(lengths: list[int]) -> tuple[SlotBatch, list[_Seq]]:
    """Slots 0..n-1 holding sequences of these prompt lengths, each slot's columns filled with
    values that name the sequence and the column (so a move that drops or shifts one shows)."""
    batch = SlotBatch(num_slots=6)
    seqs = [_Seq(f"s{n}", list(range(length))) for n, length in enumerate(lengths)]
    slots = batch.place([(seq, 0, None) for seq in seqs], SHAPE)
    batch.advance()
    for n, slot in enumerate(slots):
        first = batch.row_start[slot]
        named = 1000 * (n + 1) + torch.arange(first, batch.end, dtype=torch.float32).view(1, -1, 1)
        for layer in range(SHAPE.layers):
            batch.keys[layer][slot, :, first : batch.end] = named
            batch.values[layer][slot, :, first : batch.end] = -named
    return batch, seqs


def _contents(batch: SlotBatch, seq: _Seq) -> list[torch.Tensor]:
    slot = batch.sequences.index(seq)
    return [t.clone() for pair in batch.kv_of(slot) for t in pair]


def test_compaction_moves_the_highest_live_sequences_into_the_holes_with_their_kv():
    batch, seqs = _batch_with([3, 5, 2, 4, 6])
    before = {seq.name: _contents(batch, seq) for seq in seqs}
    batch.leave(1)
    batch.leave(3)
    assert batch.live_slots() == [0, 2, 4]
    assert batch.compact() == 1
    # s4 (slot 4) filled the hole at slot 1; slots 0..2 are the live ones.
    assert batch.live_slots() == [0, 1, 2]
    assert [batch.sequences[slot].name for slot in range(3)] == ["s0", "s4", "s2"]
    for seq in (seqs[0], seqs[2], seqs[4]):
        after = _contents(batch, seq)
        assert all(torch.equal(a, b) for a, b in zip(after, before[seq.name], strict=True)), seq.name
    assert batch.start == min(batch.row_start[slot] for slot in batch.live_slots())


def test_compaction_of_a_batch_without_holes_or_empty_moves_nothing():
    batch, seqs = _batch_with([3, 5])
    assert batch.compact() == 0
    assert batch.live_slots() == [0, 1]
    batch.leave(1)
    assert batch.compact() == 0
    batch.leave(0)
    assert batch.compact() == 0 and batch.live_slots() == []
    assert SlotBatch(num_slots=4).compact() == 0
