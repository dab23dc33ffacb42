"""Does the cuDNN attention backend (torch's SDPA default on this H100 for a masked decode) cost
a plan build per new key length? Decode steps at fresh vs already-seen shapes, cuDNN SDPA off
and on; then the engine (greedy, batch 256 x 128 tokens, ignore_eos) both ways, two runs each.

    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu/sdpa_backend.py MODEL_DIR
"""

import asyncio
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generation_core.engines.hf.engine import EngineSettings, HFEngine  # noqa: E402

engine = HFEngine(
    EngineSettings(
        sys.argv[1],
        prompt_length=512,
        response_length=128,
        max_batch_size=256,
        device="cuda",
        dtype="bfloat16",
        ignore_eos=True,
    )
)
model = engine.model


def manual(batch, ctx, steps):
    ids = torch.randint(10, 1000, (batch, ctx), device="cuda")
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True, logits_to_keep=1
    )
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(steps):
        m = torch.ones(batch, ctx + i + 1, dtype=torch.long, device="cuda")
        pos = torch.full((batch, 1), ctx + i, device="cuda")
        out = model(
            input_ids=tok, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1000


async def engine_batch(n, tokens):
    params = {"temperature": 0.0, "max_tokens": tokens}
    t = time.perf_counter()
    await asyncio.gather(
        *[
            engine.generate(str(i), prompt_ids=[1, 9, 8, 7, 6] * 8 + [i % 100 + 10], sampling_params=params)
            for i in range(n)
        ]
    )
    return n * tokens / (time.perf_counter() - t)


with torch.inference_mode():
    manual(8, 16, 2)
    for cudnn in (False, True):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        first, again = manual(256, 200, 32), manual(256, 200, 32)
        print(
            f"cuDNN SDPA {'on ' if cudnn else 'off'}: manual decode, batch 256, keys 201-232: {first:.1f} ms/step at new shapes, {again:.1f} ms/step at the same shapes again",
            flush=True,
        )
for cudnn in (False, True):
    torch.backends.cuda.enable_cudnn_sdp(cudnn)  # a process-wide switch: the engine thread sees it
    rates = [asyncio.run(engine_batch(256, 128)) for _ in range(2)]
    print(
        f"cuDNN SDPA {'on ' if cudnn else 'off'}: engine greedy batch 256 x 128: run 1 {rates[0]:.0f} tokens/s, run 2 {rates[1]:.0f} tokens/s",
        flush=True,
    )
engine.shutdown()
