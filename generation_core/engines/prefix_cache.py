"""The KV of finished sequences, kept so that a trajectory's next turn prefills only what is new.

In a multi-turn tool rollout, turn k+1's prompt is turn k's prompt + turn k's response + the
tool's reply, and the routing client sends every turn of a trajectory to the same replica
(routing.py, sticky per request id). Without this cache each turn prefills the whole
conversation again: on a CPU that makes a tool rollout ~3x slower per token than a single turn.

An entry is the KV of one finished sequence, keyed by the tokens whose KV it holds: the prompt
and every generated token but the last (the last was sampled, never fed to the model). A prompt
is served by the longest entry that is an exact prefix of it; an entry that matches only up to
a point is not served at all, even though its KV before that point would be right: the tokens
after it are what a turn extends, and a partial match is no turn of the same trajectory.

The cache holds at most `budget_bytes` of tensors; the least recently stored entries go first.
An entry is removed when it serves a prompt: that turn extends it, and its own KV, one turn
longer, is stored when it finishes, so a trajectory holds one entry whatever its number of turns.
All calls come from the engine's decode thread: nothing here locks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer, the (keys, values) of one sequence: [1, heads, tokens, head_dim] each."""


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    kv: KV
    nbytes: int


class PrefixCache:
    """A byte-bounded LRU of finished sequences' KV, looked up by exact token prefix."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], kv: KV) -> None:
        """Keep a copy of `kv`, the KV of exactly `tokens` (views into a batch's store, say),
        evicting the oldest entries to make room; one larger than the whole budget is not kept."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        key = tuple(tokens)
        self._drop(key)
        if not tokens or nbytes > self.budget_bytes:
            return
        while self.nbytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = _Entry(key, [(k.clone(), v.clone()) for k, v in kv], nbytes)
        self.nbytes += nbytes

    def take(self, prompt_ids: list[int]) -> tuple[int, KV] | None:
        """Remove and return the longest entry that `prompt_ids` starts with, as (tokens reused,
        their KV), or None. At most len(prompt_ids) - 1 tokens are reused (the KV is cut to that):
        the prompt's last token must still be fed, for the logits of the first new token."""
        if len(prompt_ids) < 2:
            return None
        best: _Entry | None = None
        for entry in self._entries.values():
            n = len(entry.tokens)
            if best is not None and n <= len(best.tokens) or n > len(prompt_ids):
                continue
            # The last token first: it rules out almost every other trajectory in O(1).
            if prompt_ids[n - 1] == entry.tokens[-1] and entry.tokens == tuple(prompt_ids[:n]):
                best = entry
        if best is None:
            return None
        self._drop(best.tokens)
        reused = min(len(best.tokens), len(prompt_ids) - 1)
        kv = best.kv if reused == len(best.tokens) else [(k[:, :, :reused], v[:, :, :reused]) for k, v in best.kv]
        return reused, kv

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
