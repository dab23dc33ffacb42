"""Per-row token sampling: temperature, top-k and top-p applied to one batch of logits.

Every row of a continuous batch may carry its own sampling parameters, so the filters are
vectorised over rows instead of taking one setting for the whole batch the way
`model.generate` does. The transformers engine's sampler, kept apart from its decode loop: a
pure tensor function with tests and GPU benchmarks of its own (bench/gpu).
"""

from __future__ import annotations

import torch

from generation_core.engines.base import SamplingParams


def sample_next_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row of `logits` [batch, vocab] under that row's parameters.

    Everything runs on `logits.device` and the result (token ids, int64) stays there: the
    caller copies only the chosen ids, never the logits. Rows without a generator are drawn
    with one batched `torch.multinomial`; a row with a generator (a seeded request) is drawn
    alone with it, so its tokens do not depend on the other rows of the batch. A generator must
    live on the logits' device.
    """
    batch, vocab = logits.shape
    device = logits.device
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return logits.argmax(dim=-1)
    chosen = torch.empty(batch, dtype=torch.long, device=device)
    if greedy_rows:
        greedy_index = torch.tensor(greedy_rows, device=device)
        chosen[greedy_index] = logits.index_select(0, greedy_index).argmax(dim=-1)

    if greedy_rows:
        sampled_index = torch.tensor(sampled_rows, device=device)
        rows = logits.index_select(0, sampled_index).float()
    else:
        sampled_index = None
        rows = logits.float()
    temperature = torch.tensor([params[i].temperature for i in sampled_rows], dtype=rows.dtype, device=device).unsqueeze(1)
    rows = rows / temperature
    if all(params[i].top_k <= 0 or params[i].top_k >= vocab for i in sampled_rows) and all(params[i].top_p >= 1.0 for i in sampled_rows):
        # Nothing to filter (the default sampling): no sort over the vocabulary, which costs
        # several times the draw itself on a CPU.
        tokens = _draw(rows.softmax(dim=-1), [generators[i] for i in sampled_rows])
    else:
        tokens = _filtered_draw(rows, [params[i] for i in sampled_rows], [generators[i] for i in sampled_rows])
    if sampled_index is None:
        return tokens
    chosen[sampled_index] = tokens
    return chosen


def _filtered_draw(rows: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of tempered logits `rows`, after that row's top-k and top-p."""
    device, vocab = rows.device, rows.shape[1]
    sorted_logits, sorted_ids = rows.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device).unsqueeze(0)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device).unsqueeze(1)
    remove = rank >= top_k
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p: the top token always survives.
    mass_before = probs.cumsum(dim=-1) - probs
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device).unsqueeze(1)
    remove |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    filtered_probs = sorted_logits.softmax(dim=-1)

    # Position (in the sorted order) of the token drawn for each row.
    return sorted_ids.gather(1, _draw(filtered_probs, generators).unsqueeze(1)).squeeze(1)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One index per row of `probs`: rows without a generator in one batched draw, a seeded row
    alone with its generator (its draw does not depend on the other rows)."""
    picks = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [n for n, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return torch.multinomial(probs, 1).squeeze(1)
    if unseeded:
        unseeded_index = torch.tensor(unseeded, device=probs.device)
        picks[unseeded_index] = torch.multinomial(probs.index_select(0, unseeded_index), 1).squeeze(1)
    for n, generator in enumerate(generators):
        if generator is not None:
            picks[n] = torch.multinomial(probs[n], 1, generator=generator)[0]
    return picks
