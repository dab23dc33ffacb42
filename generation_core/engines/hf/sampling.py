"""Per-row token sampling: temperature, top-k and top-p applied to one batch of logits.

Every row of a continuous batch may carry its own sampling parameters, so the filters are
vectorised over rows instead of taking one setting for the whole batch the way
`model.generate` does. The transformers engine's sampler, kept apart from its decode loop: a
pure tensor function with tests and GPU benchmarks of its own (bench/gpu/README.md section 4).
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
    together; a row with a generator (a seeded request) draws its random number alone with it,
    so its tokens do not depend on the other rows of the batch (_draw). A generator must live on
    the logits' device.
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
    temperature = torch.tensor(
        [params[i].temperature for i in sampled_rows], dtype=rows.dtype, device=device
    ).unsqueeze(1)
    rows = rows / temperature
    if all(params[i].top_k <= 0 or params[i].top_k >= vocab for i in sampled_rows) and all(
        params[i].top_p >= 1.0 for i in sampled_rows
    ):
        # Nothing to filter (the default sampling): no sort over the vocabulary, which costs
        # several times the draw itself on a CPU.
        tokens = _draw(rows.softmax(dim=-1), [generators[i] for i in sampled_rows])
    else:
        tokens = _filtered_draw(rows, [params[i] for i in sampled_rows], [generators[i] for i in sampled_rows])
    if sampled_index is None:
        return tokens
    chosen[sampled_index] = tokens
    return chosen


def _filtered_draw(
    rows: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
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
    """One index per row of `probs` (rows of non-negative weights), by inverse CDF: a uniform
    number per row, found in the row's cumulative sum. A seeded row's number comes from its own
    generator, so its draw does not depend on the other rows; the others' come from one batched
    draw. (`torch.multinomial` draws an exponential number for every vocabulary entry instead:
    75 ms of a 400 ms decode step of 64 rows of the bundled model on 2 CPU cores.)"""
    device = probs.device
    unseeded = [n for n, g in enumerate(generators) if g is None]
    uniform = torch.empty(probs.shape[0], dtype=torch.float64, device=device)
    if unseeded:
        uniform[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
    seeded = [n for n, g in enumerate(generators) if g is not None]
    if seeded:
        draws = [torch.rand(1, dtype=torch.float64, device=device, generator=generators[n]) for n in seeded]
        uniform[torch.tensor(seeded, device=device)] = torch.cat(draws)
    # Summed in float64: in float32 the sum of 49k entries drifts by ~1e-5, which would skew the
    # odds of the rarest tokens.
    cdf = probs.double().cumsum(dim=-1)
    picks = torch.searchsorted(cdf, uniform.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    overflow = picks >= probs.shape[1]
    if bool(overflow.any()):
        # The product rounded up to the row's total (no entry is above it): take the row's
        # likeliest token, never one its filters removed.
        picks = torch.where(overflow, probs.argmax(dim=-1), picks)
    return picks
