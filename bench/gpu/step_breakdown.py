"""Where a decode step of the engine spends its time on the GPU (issue 8, GPU check).

    python3 bench/gpu/step_breakdown.py MODEL_DIR

For batch 64 and 256 (vocab of the model): the model's decode forward (DynamicCache, 161-181
columns of context, logits of the last position), the engine's logits copy to the host
(`.float().cpu()`), and the project's `sample_next_tokens` on those host logits, greedy and
temperature 1.0; beside it the same temperature-1.0 sampling done batched on the GPU
(sort, softmax, cumsum, one `torch.multinomial` over all rows), for comparison only.
"""

import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generation_core.engines.base import SamplingParams  # noqa: E402
from generation_core.engines.hf.sampling import sample_next_tokens  # noqa: E402


def timed(fn, n=10):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1000


model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).to("cuda").eval()
vocab = model.config.vocab_size


def breakdown(batch: int) -> None:
    """One batch size's split (a function: its closures bind this call's tensors)."""
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (batch, 160), device="cuda")
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        step = torch.randint(0, vocab, (batch, 1), device="cuda")

        columns = [161]

        def forward():
            mask = torch.ones(batch, columns[0] + 1, dtype=torch.long, device="cuda")
            pos = torch.full((batch, 1), columns[0], device="cuda")
            columns[0] += 1
            return model(
                input_ids=step,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )

        forward()  # warm-up; the context then grows by one column per timed step (161 -> 181)
        fwd = timed(forward, 20)
        logits = forward().logits[:, -1, :]
        copy = timed(lambda: logits.float().cpu())
        host = logits.float().cpu()
        greedy = [SamplingParams(temperature=0.0)] * batch
        sampled = [SamplingParams(temperature=1.0)] * batch
        gens = [None] * batch
        g_ms = timed(lambda: sample_next_tokens(host, greedy, gens), 3)
        s_ms = timed(lambda: sample_next_tokens(host, sampled, gens), 3)

        def gpu_sample():
            rows = logits.float() / 1.0
            sorted_logits, sorted_ids = rows.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(-1)
            remove = (probs.cumsum(-1) - probs) >= 1.0
            pick = torch.multinomial(sorted_logits.masked_fill(remove, float("-inf")).softmax(-1), 1)
            return sorted_ids.gather(1, pick).squeeze(1).cpu()

        gpu_ms = timed(gpu_sample)
    print(
        f"batch {batch}: forward {fwd:.1f} ms | logits to host {copy:.1f} ms | sample_next_tokens on host: greedy {g_ms:.1f} ms, T=1 {s_ms:.1f} ms | "
        f"same T=1 sampling batched on the GPU {gpu_ms:.2f} ms | ceiling tokens/s: forward only {batch / fwd * 1000:.0f}, engine greedy path "
        f"{batch / (fwd + copy + g_ms) * 1000:.0f}, engine T=1 path {batch / (fwd + copy + s_ms) * 1000:.0f}",
        flush=True,
    )


for batch in (64, 256):
    breakdown(batch)


# The same split measured inside a real engine run: HFEngine's model call (prefill and decode)
# synchronised and timed, over one greedy batch of 256 requests of 128 tokens.
import asyncio  # noqa: E402

from generation_core.engines.hf.engine import EngineSettings, HFEngine  # noqa: E402

engine = HFEngine(
    EngineSettings(
        sys.argv[1],
        prompt_length=256,
        response_length=128,
        max_batch_size=256,
        device="cuda",
        dtype="bfloat16",
        ignore_eos=True,
    )
)
inner, spent = engine.model.forward, [0.0, 0]


def timed_forward(*args, **kwargs):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = inner(*args, **kwargs)
    torch.cuda.synchronize()
    spent[0] += time.perf_counter() - t
    spent[1] += 1
    return out


engine.model.forward = timed_forward


async def one_batch(n, tokens):
    params = {"temperature": 0.0, "max_tokens": tokens}
    t = time.perf_counter()
    await asyncio.gather(
        *[
            engine.generate(str(i), prompt_ids=[1, 9, 8, 7, 6] * 8 + [i % 100 + 10], sampling_params=params)
            for i in range(n)
        ]
    )
    return time.perf_counter() - t


asyncio.run(one_batch(8, 4))
spent[:] = [0.0, 0]
wall = asyncio.run(one_batch(256, 128))
print(
    f"engine, greedy batch 256 x 128 tokens: wall {wall:.2f} s, of which model forward {spent[0]:.2f} s over {spent[1]} calls ({spent[0] / spent[1] * 1000:.1f} ms each); the rest ({wall - spent[0]:.2f} s) is logits copy, sampling and batch bookkeeping on the host"
)
engine.shutdown()
