"""Decode steps of the bundled model with transformers' linear layers against weight-first ones
(generation_core/engines/hf/cpu_linear.py), side by side in one process.

    .venv/bin/python -u bench/cpu_linear.py [--rows 1 2 4 8 16 32 64] [--prefill 64 512] [--context 300] [--rounds 5] [--threads 2]

For each row count, one prefill of `--context` tokens per row, then `--rounds` rounds of 3 decode
steps with `nn.Linear` as transformers runs it and 3 with the weight-first forward (at every row
count, whatever the engine's MAX_ROWS), all on that cache, cut back after each step so that every
step is the same one; the same, a step at a time, for prefills of `--prefill` tokens (one row).
Prints the median ms per step each way, the ratio nn.Linear / weight-first (> 1: weight-first
is faster), and the largest difference between the two ways' logits.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from generation_core.config.bundled import prepare_bundled_model  # noqa: E402
from generation_core.engines.hf.cpu_linear import use_plain_linears, use_weight_first_linears  # noqa: E402


def decode_steps(model, rows: int, context: int, rounds: int) -> tuple[float, float, float]:
    """Median ms of a decode step with nn.Linear and weight-first, alternating every 3 steps over
    one prefilled cache (the same step each time: the cache is cropped back after it), and the
    largest difference between the two ways' logits."""
    from transformers import DynamicCache

    generator = torch.Generator().manual_seed(rows)
    ids = torch.randint(100, 5000, (rows, context), generator=generator)
    token = torch.randint(100, 5000, (rows, 1), generator=generator)
    times: dict[bool, list[float]] = {False: [], True: []}
    logits: dict[bool, torch.Tensor] = {}
    with torch.inference_mode():
        use_plain_linears(model)
        cache = DynamicCache()
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for _ in range(rounds):
            for weight_first in (False, True):
                use_weight_first_linears(model, max_rows=1 << 30) if weight_first else use_plain_linears(model)
                for _ in range(3):
                    started = time.perf_counter()
                    logits[weight_first] = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
                    times[weight_first].append(time.perf_counter() - started)
                    cache.crop(context)
    diff = float((logits[False] - logits[True]).abs().max())
    return 1000 * statistics.median(times[False]), 1000 * statistics.median(times[True]), diff


def prefills(model, tokens: int, rounds: int) -> tuple[float, float, float]:
    """The same for a prefill of `tokens` tokens (a wide step: one row of many tokens)."""
    ids = torch.randint(100, 5000, (1, tokens), generator=torch.Generator().manual_seed(tokens))
    times: dict[bool, list[float]] = {False: [], True: []}
    logits: dict[bool, torch.Tensor] = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for weight_first in (False, True):
                use_weight_first_linears(model, max_rows=1 << 30) if weight_first else use_plain_linears(model)
                started = time.perf_counter()
                logits[weight_first] = model(ids, logits_to_keep=1).logits
                times[weight_first].append(time.perf_counter() - started)
    diff = float((logits[False] - logits[True]).abs().max())
    return 1000 * statistics.median(times[False]), 1000 * statistics.median(times[True]), diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill", type=int, nargs="*", default=[64, 512])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(str(prepare_bundled_model()), dtype=torch.float32).eval()
    print(
        f"bundled model, {args.threads} threads, context {args.context}: median ms per step over {args.rounds} alternating rounds"
    )
    print(f"{'step':<20} {'nn.Linear':>10} {'weight-first':>13} {'ratio':>6} {'max |logit diff|':>17}")
    ratios = []
    cases = [
        (f"decode {rows:>3} rows", lambda rows=rows: decode_steps(model, rows, args.context, args.rounds))
        for rows in args.rows
    ]
    cases += [
        (f"prefill {tokens} tokens", lambda tokens=tokens: prefills(model, tokens, args.rounds))
        for tokens in args.prefill
    ]
    for name, measure in cases:
        plain, first, diff = measure()
        ratios.append(plain / first)
        print(f"{name:<20} {plain:>10.1f} {first:>13.1f} {plain / first:>6.2f} {diff:>17.2e}", flush=True)
    print(f"geometric mean of the ratios: {statistics.geometric_mean(ratios):.2f}")


if __name__ == "__main__":
    main()
