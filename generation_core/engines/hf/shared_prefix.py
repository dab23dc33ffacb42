"""Decode attention that reads a prefix many sequences share once, not once per sequence.

The prompts of a dataset usually start the same way: a system prompt, few-shot turns, the chat
header; and every turn of a multi-turn trajectory starts with its first prompt. Each slot of the
running batch (slot_batch.py) holds its own copy of that prefix's KV, and a plain decode step
reads every copy, for every row, every step. On a CPU, decode attention is bound by memory
reads, so with a 160-token system prompt most of the tool example's attention time went to
reading the same KV 64 times (bench/RESULTS.md, "A draining batch and the sampler").

Here the batch keeps one copy of the longest prefix its sequences share (`SharedPrefix`), and a
decode step splits each sharing row's attention in two (cascade attention):

- the shared prefix, read once for all rows: one attention call in which every row's queries
  attend to the prefix as to a single sequence;
- the row's own columns after the prefix, read from the slot store as before.

Each part gives its softmax-weighted values and the log of its softmax denominator
(log-sum-exp); the two merge exactly: out = (e^a o_a + e^b o_b) / (e^a + e^b), that is
o_b + sigmoid(a - b) (o_a - o_b). A row that does not share gets an empty prefix part
(log-sum-exp -inf, weight 0). The rows' own copies stay in the store
(prefix reuse, compaction and the plain decode path read them), only attention stops reading them.

CPU only: both parts use the CPU flash-attention kernel, which returns the log-sum-exp
(`aten::_scaled_dot_product_flash_attention_for_cpu`); elsewhere the engine keeps reading every
row's whole window. Measured (bench/RESULTS.md history, "A shared prefix read once"): a decode
attention call costs ~1 ms plus ~0.012 ms per column at 64 rows, so a 160-token prefix read once
saves ~1.9 ms of a layer's ~5.7 and the prefix part costs ~0.3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from generation_core.engines.hf.prefix_cache import common_prefix_length

MIN_SHARED_TOKENS = 32
"""A prefix shorter than this is read with each row's own columns: splitting it off costs an
attention call and a merge per layer for little less reading."""


@dataclass
class SharedPrefix:
    """The KV of `tokens`, which the sharing slots' prompts all start with: per layer,
    [heads, tokens, head_dim] keys and values, at positions 0..len(tokens)-1."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def copy_of(
        cls, tokens: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], slot: int, first_column: int
    ) -> SharedPrefix:
        """The prefix `tokens` as `slot` holds it at columns [first_column, + len(tokens))."""
        span = slice(first_column, first_column + len(tokens))
        return cls(tuple(tokens), [k[slot, :, span].clone() for k in keys], [v[slot, :, span].clone() for v in values])

    def __len__(self) -> int:
        return len(self.tokens)

    def common_length(self, prompt_ids: list[int]) -> int:
        """How many of this prefix's tokens `prompt_ids` starts with."""
        return common_prefix_length(self.tokens, tuple(prompt_ids), len(self.tokens))

    def shorten(self, length: int) -> None:
        """Keep the first `length` tokens (a sequence that shares only those joined)."""
        self.tokens = self.tokens[:length]
        self.keys = [k[:, :length] for k in self.keys]
        self.values = [v[:, :length] for v in self.values]


@dataclass
class CascadeStep:
    """What one decode step's attention needs besides the store: the prefix, and per row (of the
    step's decode rows) 0 where the row shares it, -inf where it does not."""

    prefix: SharedPrefix
    prefix_bias: torch.Tensor
    """[rows, 1, 1] float: added to the prefix part's log-sum-exp."""
    reading: int
    """How many decoding rows read the prefix."""


def cascade_decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    cascade: CascadeStep | None,
    layer: int,
    scale: float | None,
) -> torch.Tensor:
    """query [rows, heads, 1, dim]; keys/values [rows, kv_heads, window, dim], the rows' own
    columns (after the shared prefix for the rows that share it); mask [rows, 1, 1, window],
    additive (0 or -inf), of the query's dtype. Returns [rows, heads, 1, dim].

    The query heads of one KV head (grouped-query attention) are laid out as that head's query
    positions, [rows, kv_heads, heads per kv head, dim], so neither part repeats the KV."""
    rows, heads, _, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    grouped = query.reshape(rows, kv_heads, group, dim)
    own, own_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        grouped, keys, values, attn_mask=mask, scale=scale
    )
    if cascade is None:
        return own.reshape(rows, heads, 1, dim)
    prefix_keys, prefix_values = cascade.prefix.keys[layer], cascade.prefix.values[layer]
    # The prefix as one sequence that every row's queries attend to: [1, kv_heads, rows x group, dim].
    by_head = grouped.permute(1, 0, 2, 3).reshape(1, kv_heads, rows * group, dim)
    prefix_out, prefix_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        by_head, prefix_keys.unsqueeze(0), prefix_values.unsqueeze(0), scale=scale
    )
    prefix_out = prefix_out.view(kv_heads, rows, group, dim).permute(1, 0, 2, 3)
    prefix_lse = prefix_lse.view(kv_heads, rows, group).permute(1, 0, 2) + cascade.prefix_bias
    prefix_weight = torch.sigmoid(prefix_lse - own_lse).unsqueeze(-1).to(own.dtype)
    return torch.lerp(own, prefix_out, prefix_weight).reshape(rows, heads, 1, dim)
