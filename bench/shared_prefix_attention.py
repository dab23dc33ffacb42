"""Decode attention of one layer, each row reading its own copy of a shared prefix vs the prefix read once.

    .venv/bin/python bench/shared_prefix_attention.py [--rows 64] [--prefix 160] [--threads 2]

Shapes of the bundled model (3 KV heads, 9 query heads, head dim 64, fp32) and of the tool
example's decode steps: every row's prompt starts with the same `--prefix` tokens (the example's
system prompt and few-shot turn), and rows hold 0 to 250 tokens after it, right-aligned on the
slot store's shared timeline as in slot_batch.py. Measured side by side, alternating, in one
process: the engine's attention before (`F.scaled_dot_product_attention` over each row's whole
columns) and now (`shared_prefix.cascade_decode_attention`: the prefix once, each row's own
columns after it). Prints ms per layer call and the ratio, and checks both give the same output.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from generation_core.engines.hf.shared_prefix import CascadeStep, SharedPrefix, cascade_decode_attention

KV_HEADS, HEADS, DIM = 3, 9, 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=160)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows, prefix = args.rows, args.prefix
    after = torch.randint(0, 251, (rows,), generator=generator)
    end = prefix + int(after.max())
    keys, values = (
        torch.randn(rows, KV_HEADS, end + 1, DIM, generator=generator),
        torch.randn(rows, KV_HEADS, end + 1, DIM, generator=generator),
    )
    row_start = end - prefix - after
    shared_k, shared_v = (
        torch.randn(KV_HEADS, prefix, DIM, generator=generator),
        torch.randn(KV_HEADS, prefix, DIM, generator=generator),
    )
    for row in range(rows):
        first = int(row_start[row])
        keys[row, :, first : first + prefix], values[row, :, first : first + prefix] = shared_k, shared_v
    query = torch.randn(rows, HEADS, 1, DIM, generator=generator)
    columns = torch.arange(end + 1).unsqueeze(0)

    whole_start = int(row_start.min())
    whole_mask = (columns >= row_start.unsqueeze(1))[:, whole_start:].view(rows, 1, 1, -1)
    own_starts = row_start + prefix
    own_start = int(own_starts.min())
    own_attend = (columns >= own_starts.unsqueeze(1))[:, own_start:].view(rows, 1, 1, -1)
    own_mask = torch.zeros(own_attend.shape).masked_fill_(~own_attend, float("-inf"))
    step = CascadeStep(SharedPrefix(tuple(range(prefix)), [shared_k], [shared_v]), torch.zeros(rows, 1, 1), rows)

    def own_copies() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query, keys[:, :, whole_start:], values[:, :, whole_start:], attn_mask=whole_mask, enable_gqa=True
        )

    def shared_once() -> torch.Tensor:
        return cascade_decode_attention(
            query, keys[:, :, own_start:], values[:, :, own_start:], own_mask, step, 0, None
        )

    difference = (own_copies() - shared_once()).abs().max().item()
    assert difference < 1e-5, difference
    seconds = {own_copies: 0.0, shared_once: 0.0}
    for _ in range(20):
        own_copies(), shared_once()
    for _ in range(args.calls):
        for fn in seconds:
            started = time.perf_counter()
            fn()
            seconds[fn] += time.perf_counter() - started
    before, now = (seconds[fn] / args.calls * 1e3 for fn in (own_copies, shared_once))
    print(
        f"{rows} rows, {prefix}-token shared prefix, 0-250 tokens after it (windows {end + 1 - whole_start} -> {end + 1 - own_start} columns), {args.threads} threads"
    )
    print(
        f"each row its own copy: {before:.2f} ms/layer; prefix read once: {now:.2f} ms/layer; ratio {before / now:.2f}x (outputs differ by {difference:.1e})"
    )


if __name__ == "__main__":
    main()
