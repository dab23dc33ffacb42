"""One forward pass that decodes the running batch and prefills the joiners' prompts together.

Prefilling a joiner apart costs a forward pass of its own, and a pass over one short prompt uses
the CPU worse than a wide one (~1.5x the time per token of a 32-prompt prefill, measured on the
bundled model): with requests joining one or two at a time, that was ~15% of engine time. A
mixed step packs every token of the step into one sequence, [1, decode tokens + new prompt
tokens], so the projections and MLPs (most of the work) run once over all of them; only
attention is split, in `packed_attention`:

- the decoding slots' tokens attend, as one batched call, to their own columns of the slot store
  (slot_batch.py), exactly as a plain decode step does;
- each joiner's new tokens attend causally to its own prompt columns (a reused prefix first).

The attention function is registered with transformers under `PACKED_ATTENTION` and receives
the step's layout as the `packed_step` keyword, which transformers passes from the model call
down to every attention call. Without that keyword it is transformers' own SDPA attention, so a
model switched to it still runs ordinary forwards (a joiner prefilled apart, a padded batch).
Models whose attention does not go through transformers' attention interface cannot run mixed
steps; the engine checks mixed steps against plain forwards when it starts (`agrees_with_plain_forwards`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from generation_core.engines.hf.slot_batch import KVShape, SlotBatch

PACKED_ATTENTION = "genrun_packed_sdpa"


@dataclass
class PackedStep:
    """Where each token of a mixed step belongs. Tokens are packed decode tokens first (one per
    slot in `decoding`, in that order), then each joiner's new prompt tokens."""

    batch: SlotBatch
    decoding: list[int]
    """Slots that feed their last sampled token at column `batch.end`."""
    decoding_index: torch.Tensor
    """`decoding` as a tensor on the model's device."""
    decode_rows: int
    """Slots [0, decode_rows) take part in the batched decode attention (highest decoding slot + 1)."""
    decode_start: int
    """First column any decoding slot attends to in the store."""
    decode_mask: torch.Tensor | None
    """[decode_rows, 1, 1, end - decode_start + 1] bool (slot_batch.decode_mask)."""
    joiners: list[tuple[int, int, int]]
    """(slot, first prompt column, new tokens) per joiner: its new tokens are its prompt's last
    ones, ending at column `batch.end`."""

    @classmethod
    def build(
        cls, batch: SlotBatch, decoding: list[int], joiners: list[tuple[int, list[int], int]], device: str
    ) -> PackedInput:
        """Lay out one step: every slot in `decoding` feeds its last sampled token; each joiner
        (slot, prompt ids, tokens reused from a cached prefix) feeds its prompt after the reused
        part. Joiners must already be placed in `batch` (SlotBatch.place)."""
        ids = [batch.sequences[slot].token_ids[-1] for slot in decoding]
        positions = [batch.end - batch.row_start[slot] for slot in decoding]
        keep = list(range(len(decoding)))
        layout = []
        for slot, prompt_ids, reused in joiners:
            ids.extend(prompt_ids[reused:])
            positions.extend(range(reused, len(prompt_ids)))
            keep.append(len(ids) - 1)
            layout.append((slot, batch.row_start[slot], len(prompt_ids) - reused))
        rows = max(decoding) + 1 if decoding else 0
        decode_start = min((batch.row_start[slot] for slot in decoding), default=batch.end)
        step = cls(
            batch=batch,
            decoding=decoding,
            decoding_index=torch.tensor(decoding, dtype=torch.long, device=device),
            decode_rows=rows,
            decode_start=decode_start,
            decode_mask=batch.decode_mask(rows, decoding, decode_start, device) if decoding else None,
            joiners=layout,
        )
        return PackedInput(step, ids, positions, keep)

    def cache(self) -> Cache:
        return Cache(layers=[_PackedLayer(self, layer) for layer in range(len(self.batch.keys))])


@dataclass
class PackedInput:
    """A mixed step's model input: packed token ids and positions, and the packed positions
    whose logits are kept (each decoding slot's token, each joiner's last prompt token)."""

    step: PackedStep
    ids: list[int]
    positions: list[int]
    keep: list[int]


class _PackedLayer(DynamicLayer):
    """Writes a mixed step's new keys and values into the slot store, where attention reads them."""

    def __init__(self, step: PackedStep, layer: int):
        super().__init__()
        self.step, self.layer = step, layer
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        step, b, end = self.step, self.step.batch, self.step.batch.end
        n = len(step.decoding)
        for store, new in ((b.keys[self.layer], key_states), (b.values[self.layer], value_states)):
            if n:
                store[step.decoding_index, :, end] = new[0, :, :n].transpose(0, 1)
            offset = n
            for slot, _, count in step.joiners:
                store[slot, :, end + 1 - count : end + 1] = new[0, :, offset : offset + count]
                offset += count
        # Attention reads the store itself (packed_attention): what is returned is not used.
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.step.batch.end - self.step.batch.start


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_step: PackedStep | None = None,
    **kwargs,
):
    """transformers' attention contract: query [1, heads, tokens, dim] -> ([1, tokens, heads, dim], None)."""
    if packed_step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    step, b = packed_step, packed_step.batch
    keys, values = b.keys[module.layer_idx], b.values[module.layer_idx]
    heads, dim = query.shape[1], query.shape[3]
    gqa = heads != keys.shape[1]
    out = query.new_empty(1, query.shape[2], heads, dim)
    n = len(step.decoding)
    if n:
        # Rows of slots that do not decode now (free, or joining) get a zero query; their
        # output is dropped. The store is read in place, never gathered.
        q = query.new_zeros(step.decode_rows, heads, 1, dim)
        q[step.decoding_index, :, 0] = query[0, :, :n].transpose(0, 1)
        window = slice(step.decode_start, b.end + 1)
        k, v = keys[: step.decode_rows, :, window], values[: step.decode_rows, :, window]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=step.decode_mask, scale=scaling, enable_gqa=gqa)
        out[0, :n] = o[step.decoding_index, :, 0]
    offset = n
    for slot, first, count in step.joiners:
        q = query[:, :, offset : offset + count]
        k = keys[slot : slot + 1, :, first : b.end + 1]
        v = values[slot : slot + 1, :, first : b.end + 1]
        prompt = k.shape[2]
        if count == prompt:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            # After a reused prefix: new token i sees the prefix and new tokens 0..i.
            mask = torch.arange(prompt, device=q.device).unsqueeze(0) <= torch.arange(
                prompt - count, prompt, device=q.device
            ).unsqueeze(1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[0, offset : offset + count] = o[0].transpose(0, 1)
        offset += count
    return out, None


def forward(model, packed: PackedInput, device: str, accepts_logits_to_keep: bool) -> torch.Tensor:
    """Run one mixed step; returns the float logits of the packed positions `packed.keep`."""
    step = packed.step
    keep_index = torch.tensor(packed.keep, dtype=torch.long, device=device)
    out = model(
        input_ids=torch.tensor([packed.ids], device=device),
        position_ids=torch.tensor([packed.positions], device=device),
        # A 4D mask goes through transformers' mask preparation untouched; attention ignores it.
        attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device),
        past_key_values=step.cache(),
        use_cache=True,
        packed_step=step,
        **({"logits_to_keep": keep_index} if accepts_logits_to_keep else {}),
    )
    logits = out.logits[0] if accepts_logits_to_keep else out.logits[0, keep_index]
    return logits.float()


@dataclass
class _Probe:
    prompt_ids: list[int]
    token_ids: list[int]


def agrees_with_plain_forwards(model, shape: KVShape, device: str, accepts_logits_to_keep: bool) -> bool:
    """Two mixed steps on a scratch batch (two prompts joining; then both decoding while a third
    joins) give the last-position logits of plain forwards over the same tokens."""
    vocab = int(model.config.get_text_config().vocab_size)
    tails = [[(37 * i + 11 * j + 5) % vocab for j in range(length)] for i, length in enumerate((45, 49, 3))]
    probes = [_Probe(prompt, []) for prompt in tails]
    tolerance = 1e-3 if shape.dtype == torch.float32 else 5e-2
    batch = SlotBatch(4)

    def plain(tokens: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([tokens], device=device)).logits[0, -1].float()

    def step(decoding: list[int], joining: list[_Probe]) -> torch.Tensor:
        slots = batch.place([(probe, 0, None) for probe in joining], shape)
        packed = PackedStep.build(
            batch, decoding, [(slot, probe.prompt_ids, 0) for slot, probe in zip(slots, joining, strict=True)], device
        )
        logits = forward(model, packed, device, accepts_logits_to_keep)
        batch.advance()
        return logits

    def close(got: torch.Tensor, want: torch.Tensor) -> bool:
        return bool((got - want).abs().max() <= tolerance * (1 + want.abs().max()))

    first = step([], probes[:2])
    if not all(close(first[n], plain(probes[n].prompt_ids)) for n in range(2)):
        return False
    decoding = [s for s in batch.live_slots()]
    for n, probe in enumerate(probes[:2]):
        probe.token_ids.append(int(first[n].argmax()))
    second = step(decoding, probes[2:])
    wanted = [plain(probe.prompt_ids + probe.token_ids) for probe in probes[:2]] + [plain(probes[2].prompt_ids)]
    return all(close(second[n], wanted[n]) for n in range(3))


def register() -> None:
    """Make PACKED_ATTENTION a transformers attention implementation (idempotent)."""
    AttentionInterface.register(PACKED_ATTENTION, packed_attention)
    # Plain forwards under this implementation build their masks as SDPA's; a mixed step passes
    # a 4D placeholder mask, which transformers hands through untouched.
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)
