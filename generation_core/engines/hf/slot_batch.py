"""The transformers engine's running decode batch: one slot per sequence in a preallocated KV store.

All slots share one column timeline: a step writes every decoding slot's new key/value at column
`end`, in place. A sequence that joins with a prompt of p tokens has its prompt's KV at columns
[end - p + 1, end + 1) of a free slot (mixed steps: prefilled in the step it joins, beside the
decode tokens) or [end - p, end) (a joiner prefilled apart, before the step), and attends only to
its own columns (per-slot attention mask), so the rest of the batch is never copied when somebody
joins. When somebody leaves, the next step starts by moving the highest live sequence into the
freed slot (`compact`, one slot's columns copied), so a step's rows are its live sequences.
Attention sees the window [start, end], where `start` is the oldest live sequence's first column;
the store is shifted left (one copy) only when it runs out of room. A row in a step that does not
decode (a joiner, a free slot) rides along masked to the column being written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from generation_core.engines.hf.prefix_cache import KV


@dataclass(frozen=True)
class KVShape:
    """What one slot's KV looks like per layer: [heads, columns, head_dim] of `dtype` on `device`."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype, device: str) -> KVShape:
        """From a transformers config of the usual decoder shape (num_key_value_heads, head_dim)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
        return cls(int(text.num_hidden_layers), heads, head_dim, dtype, device)


class SlotBatch:
    """The running decode batch (see the module docstring)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.sequences: list[Any] = [None] * num_slots  # an engine's sequence per slot; None: free
        self.row_start = [0] * num_slots
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.start = 0
        self.end = 0
        self.cache = Cache(layers=[])

    # ---- membership ------------------------------------------------------------------------

    def live_slots(self) -> list[int]:
        return [slot for slot, seq in enumerate(self.sequences) if seq is not None]

    def free_slots(self) -> int:
        return sum(seq is None for seq in self.sequences)

    def join(self, seq: Any, kv: KV) -> None:
        """Put `seq`, prefilled apart, in the lowest free slot; `kv` is its prompt's KV,
        [1, heads, width, dim] per layer with the prompt right-aligned (left padding). It feeds
        its first sampled token at column `end`."""
        p = len(seq.prompt_ids)
        if not self.keys:
            self._allocate_like(kv, columns=max(2 * p, 64))
            self.start = self.end = p
        elif self.end < p:
            self._shift(p - self.end)
        slot = self.sequences.index(None)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][slot, :, self.end - p : self.end] = k[0, :, -p:]
            self.values[layer][slot, :, self.end - p : self.end] = v[0, :, -p:]
        self._occupy(slot, seq, self.end - p)

    def place(self, joiners: list[tuple[Any, int, KV | None]], shape: KVShape) -> list[int]:
        """Mixed step: put each (sequence, tokens reused, their KV) in a free slot with its prompt
        at columns [end - p + 1, end + 1), the reused prefix's KV copied in; the step then
        writes the rest of the prompt there, beside the decoding slots' column `end`. Returns
        the slots, in the order given. The caller has checked there are enough free slots."""
        self.make_room(max(len(seq.prompt_ids) for seq, _, _ in joiners), shape)
        slots = []
        for seq, reused, prefix in joiners:
            slot = self.sequences.index(None)
            first = self.end + 1 - len(seq.prompt_ids)
            if prefix is not None:
                for layer, (k, v) in enumerate(prefix):
                    self.keys[layer][slot, :, first : first + reused] = k[0]
                    self.values[layer][slot, :, first : first + reused] = v[0]
            self._occupy(slot, seq, first)
            slots.append(slot)
        return slots

    def make_room(self, longest_prompt: int, shape: KVShape) -> None:
        """Before a mixed step: column `end` is in the store, and a prompt of `longest_prompt`
        tokens fits in the columns up to it."""
        if not self.keys:
            self._allocate(shape, columns=max(2 * longest_prompt, 64))
        if not self.live_slots():
            # Nothing to keep: start a fresh timeline where the longest prompt just fits.
            if longest_prompt > self.keys[0].shape[2]:
                self._allocate(shape, columns=2 * longest_prompt)
            self.start = self.end = longest_prompt - 1
            return
        if self.end >= self.keys[0].shape[2]:
            self._make_room()
        if self.end < longest_prompt - 1:
            self._shift(longest_prompt - 1 - self.end)

    def _occupy(self, slot: int, seq: Any, first_column: int) -> None:
        self.sequences[slot] = seq
        self.row_start[slot] = first_column
        self.start = min(self.row_start[s] for s in self.live_slots())

    def kv_of(self, slot: int) -> KV:
        """What `slot` holds, as views into the store: columns [row_start, end) of each layer."""
        lo, hi = self.row_start[slot], self.end
        return [
            (k[slot : slot + 1, :, lo:hi], v[slot : slot + 1, :, lo:hi])
            for k, v in zip(self.keys, self.values, strict=True)
        ]

    def leave(self, slot: int) -> None:
        self.sequences[slot] = None
        live = self.live_slots()
        if not live:
            # Empty: the next joiner starts a fresh timeline (memory is kept for it).
            self.start = self.end = 0
            return
        self.start = min(self.row_start[s] for s in live)

    def compact(self) -> int:
        """Move the highest live sequences down into the free slots below them, so that slots
        [0, live) are the live ones; returns how many moved. A step runs attention over every row
        up to the highest live slot: without this, a batch that drains (the end of a run, when no
        joiner refills the slots) keeps paying for the rows its finished sequences left (a step
        decoding 9 sequences took 300 ms with 64 rows, 190 ms with 9). A move copies one slot's
        columns."""
        live = self.live_slots()
        holes = [slot for slot in range(len(live)) if self.sequences[slot] is None]
        movers = [slot for slot in reversed(live) if slot >= len(live)]
        for hole, slot in zip(holes, movers, strict=True):
            lo = self.row_start[slot]
            for store in (self.keys, self.values):
                for layer in store:
                    layer[hole, :, lo : self.end] = layer[slot, :, lo : self.end]
            self.sequences[hole], self.sequences[slot] = self.sequences[slot], None
            self.row_start[hole] = lo
        return len(holes)

    # ---- one step --------------------------------------------------------------------------

    def decode_mask(self, rows: int, decoding: list[int], first_column: int, device: str) -> torch.Tensor:
        """[rows, 1, 1, end - first_column + 1] bool (True: attend): a decoding slot attends to its
        own columns; any other slot (free, or joining this step) to the column being written only,
        so that no row's softmax is empty."""
        decoding_set = set(decoding)
        starts = torch.tensor([self.row_start[s] if s in decoding_set else self.end for s in range(rows)]).unsqueeze(1)
        columns = torch.arange(first_column, self.end + 1).unsqueeze(0)
        return (columns >= starts).view(rows, 1, 1, -1).to(device)

    def step_inputs(self, device: str) -> dict[str, torch.Tensor]:
        """Model inputs for one plain decode step over slots [0, highest live slot] (the path for
        models whose attention the mixed step cannot drive)."""
        if self.end >= self.keys[0].shape[2]:
            self._make_room()
        rows = max(self.live_slots()) + 1
        last, starts = [], []
        for slot in range(rows):
            seq = self.sequences[slot]
            # A free slot attends only to the new column: no empty softmax, no effect on others.
            last.append(seq.token_ids[-1] if seq is not None else 0)
            starts.append(self.row_start[slot] if seq is not None else self.end)
        starts_t = torch.tensor(starts).unsqueeze(1)
        columns = torch.arange(self.start, self.end + 1).unsqueeze(0)
        self.cache.layers = [_WindowLayer(self, layer, rows) for layer in range(len(self.keys))]
        return {
            "input_ids": torch.tensor(last).unsqueeze(1).to(device),
            "attention_mask": (columns >= starts_t).long().to(device),
            "position_ids": (self.end - starts_t).to(device),
        }

    def advance(self) -> None:
        self.end += 1

    # ---- storage ---------------------------------------------------------------------------

    def _allocate_like(self, kv: KV, columns: int) -> None:
        self.keys = [k.new_zeros((self.num_slots, k.shape[1], columns, k.shape[3])) for k, _ in kv]
        self.values = [v.new_zeros((self.num_slots, v.shape[1], columns, v.shape[3])) for _, v in kv]

    def _allocate(self, shape: KVShape, columns: int) -> None:
        size = (self.num_slots, shape.heads, columns, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=shape.dtype, device=shape.device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=shape.dtype, device=shape.device) for _ in range(shape.layers)]

    def _make_room(self) -> None:
        """The next column is past the store: shift the window to column 0 when that frees at
        least a quarter of the store, otherwise double it."""
        capacity = self.keys[0].shape[2]
        if self.start >= capacity // 4:
            self._shift(-self.start)
        else:
            self._resize(2 * capacity, 0)

    def _shift(self, by: int) -> None:
        """Move every column by `by` (negative: left), growing the store if needed."""
        capacity = self.keys[0].shape[2]
        self._resize(max(capacity, self.end + by + 1), by)

    def _resize(self, capacity: int, shift: int) -> None:
        lo, hi = self.start, self.end
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                new = old.new_zeros((old.shape[0], old.shape[1], capacity, old.shape[3]))
                new[:, :, lo + shift : hi + shift] = old[:, :, lo:hi]
                store[layer] = new
        self.row_start = [start + shift for start in self.row_start]
        self.start, self.end = lo + shift, hi + shift


class _WindowLayer(DynamicLayer):
    """One layer of the slot store as transformers sees it during a plain decode step: the new
    key and value are written at column `end` in place, and attention gets the window [start, end]."""

    def __init__(self, batch: SlotBatch, layer: int, rows: int):
        super().__init__()
        self.batch, self.layer, self.rows = batch, layer, rows
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        b, layer, rows = self.batch, self.layer, self.rows
        b.keys[layer][:rows, :, b.end : b.end + 1] = key_states
        b.values[layer][:rows, :, b.end : b.end + 1] = value_states
        return b.keys[layer][:rows, :, b.start : b.end + 1], b.values[layer][:rows, :, b.start : b.end + 1]

    def get_seq_length(self) -> int:
        return self.batch.end - self.batch.start
