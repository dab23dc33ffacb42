"""KV kept so that a prompt prefills only what no earlier sequence already computed.

Two kinds of entries, looked up together:

- a finished sequence's KV (its prompt and every generated token but the last, which was
  sampled, never fed). In a multi-turn tool rollout, turn k+1's prompt is turn k's prompt + turn
  k's response + the tool's reply, and the routing client sends every turn of a trajectory to
  the same replica (routing.py, sticky per request id): without this each turn prefills the
  whole conversation again. Such an entry is taken (removed) when a prompt extends it: that turn
  extends it, and its own KV, one turn longer, is stored when it finishes, so a trajectory holds
  one entry whatever its number of turns.
- a prompt's KV, stored when the prompt was prefilled without any reuse (`shared=True`): the
  system prompt and chat header that every prompt of a dataset starts with, or the same prompt
  again (rollout.n samples). It is never taken, only read.

A prompt whose own earlier turn is here reuses that turn's KV; otherwise it reuses the longest
prefix it has in common with any entry, when that is at least `min_shared_tokens` long (the KV of
positions [0, L) depends only on tokens [0, L)). The cache holds at most `budget_bytes` of
tensors; the least recently stored or read entries go first. All calls come from the engine's
decode thread: nothing here locks.
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
    shared: bool


@dataclass
class PrefixHit:
    """What a prompt reuses: its first `reused` tokens' KV."""

    reused: int
    kv: KV
    own: bool
    """The prompt extends this entry's sequence (its trajectory's previous turn): the entry was taken."""


class PrefixCache:
    """A byte-bounded LRU of finished sequences' KV, looked up by exact token prefix."""

    def __init__(self, budget_bytes: int, min_shared_tokens: int = 16):
        self.budget_bytes = budget_bytes
        self.min_shared_tokens = min_shared_tokens
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], kv: KV, shared: bool = False) -> None:
        """Keep a copy of `kv`, the KV of exactly `tokens` (views into a batch's store, say),
        evicting the oldest entries to make room; one larger than the whole budget is not kept.
        `shared`: a prompt's KV, read by other prompts and never taken."""
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        key = tuple(tokens)
        self._drop(key)
        if not tokens or nbytes > self.budget_bytes:
            return
        while self.nbytes + nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = _Entry(key, [(k.clone(), v.clone()) for k, v in kv], nbytes, shared)
        self.nbytes += nbytes

    def take(self, prompt_ids: list[int]) -> PrefixHit | None:
        """The KV `prompt_ids` can reuse, or None: the longest finished sequence it extends
        (removed from the cache), else the longest prefix it shares with any entry, if at least
        min_shared_tokens long (the entry stays). At most len(prompt_ids) - 1 tokens are reused:
        the prompt's last token must still be fed, for the logits of the first new token."""
        if len(prompt_ids) < 2:
            return None
        limit = len(prompt_ids) - 1
        prompt = tuple(prompt_ids)
        own: _Entry | None = None
        common, common_len = None, 0
        for entry in self._entries.values():
            n = len(entry.tokens)
            if not entry.shared and n <= len(prompt) and (own is None or n > len(own.tokens)):
                # The last token first: it rules out almost every other trajectory in O(1).
                if prompt[n - 1] == entry.tokens[-1] and prompt[:n] == entry.tokens:
                    own = entry
                    continue
            length = common_prefix_length(entry.tokens, prompt, limit)
            if length > common_len:
                common, common_len = entry, length
        if own is not None:
            self._drop(own.tokens)
            reused = min(len(own.tokens), limit)
            kv = own.kv if reused == len(own.tokens) else _cut(own.kv, reused)
            return PrefixHit(reused, kv, own=True)
        if common is None or common_len < self.min_shared_tokens:
            return None
        self._entries.move_to_end(common.tokens)
        return PrefixHit(common_len, _cut(common.kv, common_len), own=False)

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes


def _cut(kv: KV, tokens: int) -> KV:
    return [(k[:, :, :tokens], v[:, :, :tokens]) for k, v in kv]


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """Length of the longest common prefix of `a` and `b`, at most `limit`: a binary search
    over slice comparisons (each runs in C), not a Python loop over tokens."""
    high = min(len(a), len(b), limit)
    if high == 0 or a[0] != b[0]:
        return 0
    if a[:high] == b[:high]:
        return high
    low = 1  # a[:low] == b[:low]; a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low
