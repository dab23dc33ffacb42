"""Linear layers on a CPU computed weight-first: `W @ x^T` instead of transformers' `x @ W^T`.

A decode step of a small model on a CPU is bound by reading its weights from memory: every step
streams each weight matrix once (the bundled 135M model: ~540 MB of float32, the tied vocabulary
projection a fifth of it). `nn.Linear` asks the BLAS for `x @ W^T` with the weight as the
transposed right-hand operand. With few rows (a draining batch, a short mixed step) MKL's kernel
for that layout reads the weight at a fraction of the memory's speed (most likely it repacks the
whole weight on every call): on the 2-core machine of bench/RESULTS.md the vocabulary projection
took 32-48 ms at 2-3 rows against 15 ms at one row (a matrix-vector product). Asking for the same
product the other way round, `(W @ x^T)^T`, puts the weight on the left, where the kernel streams
it; the only extra work is copying the small [rows, out] result into row-major order.

Measured on the bundled model (bench/RESULTS.md history, "Weight-first linear layers": decode steps
over 300-token sequences, the two ways alternating on one cache, median of 15 steps each): 1.9x
faster steps at 2 and 4 rows, 1.05-1.17x at 8-64 rows (the batch sizes a run decodes), 1.0x at one
row (a matrix-vector product either way) and 0.86x for a 512-token prefill. So one row and calls
of more than MAX_ROWS rows keep `nn.Linear`. For the shapes measured the two ways give logits
within 6e-5 of each other (bitwise equal from 12 rows on), and the engine still checks its steps
against plain forwards when it starts.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.nn import functional as F

MAX_ROWS = 128
"""Most rows a call sends weight-first. Wider calls (a prefill of hundreds of tokens) are bound
by arithmetic, not by reading the weight, and ran slower weight-first (0.86x at 512 tokens)."""

WEIGHT_FIRST = "_genrun_weight_first"
"""Set on a linear layer whose forward this module replaced (so that it is replaced once)."""


def weight_first_forward(layer: nn.Linear, x: torch.Tensor, max_rows: int = MAX_ROWS) -> torch.Tensor:
    """`layer(x)` computed as `(W @ x^T)^T` when 2 to `max_rows` rows go through it."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 2 <= rows <= max_rows or x.dtype != layer.weight.dtype:
        return F.linear(x, layer.weight, layer.bias)
    flat = x.reshape(rows, x.shape[-1])
    if layer.bias is None:
        out = torch.mm(layer.weight, flat.t())
    else:
        out = torch.addmm(layer.bias.unsqueeze(1), layer.weight, flat.t())
    # Row-major again: the model's next operations view it per head or per position.
    return out.t().contiguous().view(*x.shape[:-1], layer.weight.shape[0])


def use_weight_first_linears(model: nn.Module, max_rows: int = MAX_ROWS) -> int:
    """Compute every plain `nn.Linear` of `model` whose weight is a floating-point CPU tensor
    weight-first (see the module docstring); returns how many layers that is. Subclasses of
    `nn.Linear` (quantized or adapter layers) keep their own forward."""
    changed = 0
    for module in model.modules():
        if type(module) is not nn.Linear or getattr(module, WEIGHT_FIRST, False):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or not weight.dtype.is_floating_point:
            continue
        # An instance attribute over the class method (nn.Module.__setattr__ stores plain values the same way).
        vars(module)["forward"] = types.MethodType(functools.partial(weight_first_forward, max_rows=max_rows), module)
        setattr(module, WEIGHT_FIRST, True)
        changed += 1
    return changed


def use_plain_linears(model: nn.Module) -> None:
    """Undo `use_weight_first_linears`."""
    for module in model.modules():
        if getattr(module, WEIGHT_FIRST, False):
            del module.forward
            setattr(module, WEIGHT_FIRST, False)
