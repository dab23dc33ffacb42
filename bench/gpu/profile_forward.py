"""Why a decode forward outside `model.generate` is slower: torch.profiler over 5 decode steps
of batch 256 done by hand (as the engine does: 2-D mask, position_ids, DynamicCache) vs
`model.generate` making 5 tokens for the same batch.

    python3 bench/gpu/profile_forward.py MODEL_DIR
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, DynamicCache

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
batch, ctx = 256, 160
ids = torch.randint(10, 1000, (batch, ctx), device="cuda")
mask = torch.ones(batch, ctx, dtype=torch.long, device="cuda")


def manual(steps):
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    for i in range(steps):
        m = torch.ones(batch, ctx + i + 1, dtype=torch.long, device="cuda")
        pos = torch.full((batch, 1), ctx + i, device="cuda")
        out = model(
            input_ids=tok, attention_mask=m, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
    torch.cuda.synchronize()


def generate(steps):
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=2
    )
    torch.cuda.synchronize()


with torch.inference_mode():
    for name, fn in (("manual", manual), ("generate", generate)):
        fn(2)
        t = time.perf_counter()
        fn(1)
        one = time.perf_counter() - t
        t = time.perf_counter()
        fn(33)
        many = time.perf_counter() - t
        print(f"{name}: {(many - one) / 32 * 1000:.1f} ms per decode step (batch {batch})", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(5)
        print(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60), flush=True
        )
