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


def _prompted_batch(prompts: list[list[int]]) -> tuple[SlotBatch, list[int]]:
    """A batch that shares prefixes, holding these prompts (prefilled), every slot decoding next."""
    batch = SlotBatch(num_slots=6, share_prefixes=True)
    slots = batch.place([(_Seq(f"p{n}", prompt), 0, None) for n, prompt in enumerate(prompts)], SHAPE)
    batch.advance()
    for slot in slots:
        first = batch.row_start[slot]
        for layer in range(SHAPE.layers):
            # Column values stand for the tokens at those positions: equal prefixes, equal KV.
            tokens = torch.tensor(batch.sequences[slot].prompt_ids, dtype=torch.float32).view(1, -1, 1)
            batch.keys[layer][slot, :, first : batch.end] = tokens
            batch.values[layer][slot, :, first : batch.end] = -tokens
    return batch, slots


def test_the_shared_prefix_is_cut_to_what_the_sharers_have_in_common_and_others_read_their_own():
    system = list(range(100, 140))  # 40 tokens, above MIN_SHARED_TOKENS
    batch, slots = _prompted_batch([system + [1, 2, 3], system + [4, 5], system[:36] + [9] * 8, [7] * 50])
    batch.share_prefix(slots)
    # The first prompt became the prefix; the second cut it to the 40 tokens they share; the
    # third to 36; the fourth shares 0 (and the prefix has readers): it reads its own columns.
    assert [batch.shares[s] for s in slots] == [True, True, True, False]
    assert batch.prefix.tokens == tuple(system[:36])
    assert batch.prefix.keys[0][0, :, 0].tolist() == system[:36]
    assert [batch.own_start(s) - batch.row_start[s] for s in slots] == [36, 36, 36, 0]
    # The step's mask lets each row see its own columns after the prefix it reads; the bias
    # drops the prefix part for the row that does not read it.
    first = min(batch.own_start(s) for s in slots)
    mask = batch.decode_mask(4, slots, first, "cpu", additive=torch.float32)
    for s in slots:
        visible = (mask[s, 0, 0] == 0).nonzero().flatten() + first
        assert visible.tolist() == list(range(batch.own_start(s), batch.end + 1))
    assert batch.prefix_bias(4, slots, "cpu").flatten().tolist() == [0.0, 0.0, 0.0, float("-inf")]


def test_a_prefix_nobody_reads_gives_way_to_the_next_prompt():
    batch, slots = _prompted_batch([list(range(100, 140)), [7] * 50])
    batch.share_prefix(slots[:1])
    batch.leave(slots[0])
    batch.share_prefix(slots[1:])
    assert batch.shares[slots[1]] and batch.prefix.tokens == tuple([7] * 50)
    # A prompt shorter than MIN_SHARED_TOKENS neither starts nor joins a prefix.
    short, (slot,) = _prompted_batch([[3] * 10])
    short.share_prefix([slot])
    assert short.prefix is None and short.shares[slot] is False


def test_cascade_attention_equals_attention_over_each_rows_whole_columns():
    from generation_core.engines.hf.shared_prefix import CascadeStep, SharedPrefix, cascade_decode_attention

    torch.manual_seed(0)
    rows, kv_heads, group, dim, prefix, columns = 5, 2, 3, 8, 12, 30
    keys, values = torch.randn(rows, kv_heads, columns, dim), torch.randn(rows, kv_heads, columns, dim)
    starts = [0, 4, 9, 2, 15]
    reads = [True, True, False, True, False]
    shared_k, shared_v = torch.randn(kv_heads, prefix, dim), torch.randn(kv_heads, prefix, dim)
    for row, start in enumerate(starts):
        if reads[row]:
            keys[row, :, start : start + prefix], values[row, :, start : start + prefix] = shared_k, shared_v
    query = torch.randn(rows, kv_heads * group, 1, dim)
    cols = torch.arange(columns)
    whole = cols.unsqueeze(0) >= torch.tensor(starts).unsqueeze(1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=whole.view(rows, 1, 1, -1), enable_gqa=True
    )
    own = cols.unsqueeze(0) >= torch.tensor([s + prefix * r for s, r in zip(starts, reads, strict=True)]).unsqueeze(1)
    mask = torch.zeros(rows, 1, 1, columns).masked_fill_(~own.view(rows, 1, 1, -1), float("-inf"))
    bias = torch.tensor([0.0 if r else float("-inf") for r in reads]).view(rows, 1, 1)
    step = CascadeStep(SharedPrefix(tuple(range(prefix)), [shared_k], [shared_v]), bias, sum(reads))
    got = cascade_decode_attention(query, keys, values, mask, step, 0, None)
    assert (got - expected).abs().max().item() < 1e-5
