"""On-device sampling check (issue 8 follow-up): `sample_next_tokens` on CUDA logits.

    PYTHONPATH=/tmp/site:$PWD python3 bench/gpu/sampling_on_gpu.py MODEL_DIR

1. Per-row semantics on random CUDA logits (mixed greedy / top-k / top-p / seeded rows):
   greedy rows = argmax, sampled tokens inside each row's top-k / top-p set, a seeded row
   (CUDA generator) repeats its draw whatever the other rows are.
2. Through the engine on CUDA: two requests with the same seed give the same tokens, and the
   returned logprobs match a re-score of prompt + response by the same model (raw logits).
3. Time of one `sample_next_tokens` call + copy of the chosen ids to the host, batch 64 / 256,
   vocab of the model, T=1 (the per-step host cost that bench/gpu/README.md measured at
   133.6 / 515.6 ms).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from generation_core.engines.base import SamplingParams  # noqa: E402
from generation_core.engines.hf.engine import EngineSettings, HFEngine  # noqa: E402
from generation_core.engines.hf.sampling import sample_next_tokens  # noqa: E402


def semantics(vocab: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, vocab, device="cuda") * 3
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.3),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=20, seed=3),
        SamplingParams(temperature=1.0, top_k=1),
    ]
    gen = lambda: torch.Generator(device="cuda").manual_seed(3)  # noqa: E731
    top5 = logits[1].topk(5).indices
    probs = (logits[2] / 0.7).softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = order[: int(((sorted_p.cumsum(0) - sorted_p) < 0.3).sum())]
    seeded = []
    for _ in range(50):
        chosen = sample_next_tokens(logits, params, [None, None, None, None, gen(), None])
        assert chosen.device.type == "cuda"
        assert int(chosen[0]) == int(logits[0].argmax()) and int(chosen[5]) == int(logits[5].argmax())
        assert int(chosen[1]) in top5.tolist()
        assert int(chosen[2]) in nucleus.tolist()
        seeded.append(int(chosen[4]))
    alone = sample_next_tokens(logits[4:5], params[4:5], [gen()])
    assert len(set(seeded)) == 1 and seeded[0] == int(alone[0]), seeded
    print(f"semantics on cuda: ok (greedy, top-k 5, top-p 0.3 set of {len(nucleus)}, seeded row repeats: {seeded[0]})")


def engine_check(model_dir: str) -> None:
    engine = HFEngine(
        EngineSettings(
            model_dir, prompt_length=64, response_length=16, max_batch_size=8, device="cuda", dtype="bfloat16"
        )
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    params = {"temperature": 1.0, "top_k": 50, "seed": 11, "logprobs": True, "max_tokens": 16, "ignore_eos": True}

    async def go():
        return await asyncio.gather(
            engine.generate("a", prompt_ids=prompt, sampling_params=params),
            engine.generate("b", prompt_ids=prompt, sampling_params=params),
            engine.generate("c", prompt_ids=prompt, sampling_params={**params, "seed": None}),
        )

    a, b, _c = asyncio.run(go())
    same = "same seed -> same" if a.token_ids == b.token_ids else "MISMATCH: same seed gave different"
    with torch.inference_mode():
        ids = torch.tensor([prompt + a.token_ids], device="cuda")
        raw = engine.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
        rescored = raw.gather(1, torch.tensor(a.token_ids, device="cuda").unsqueeze(1)).squeeze(1).tolist()
    diff = max(abs(x - y) for x, y in zip(a.log_probs, rescored, strict=True))
    engine.shutdown()
    print(
        f"engine on cuda: {same} {len(a.token_ids)} tokens; logprobs vs re-score max |diff| {diff:.4f} (bf16 cached vs full forward)"
    )


def timing(vocab: int) -> None:
    for batch in (64, 256):
        logits = torch.randn(batch, vocab, device="cuda", dtype=torch.bfloat16).float()
        params = [SamplingParams(temperature=1.0)] * batch
        for _ in range(3):
            sample_next_tokens(logits, params, [None] * batch).tolist()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(20):
            sample_next_tokens(logits, params, [None] * batch).tolist()
        ms = (time.perf_counter() - started) / 20 * 1000
        print(f"sample_next_tokens T=1 on cuda + ids to host, batch {batch}: {ms:.2f} ms per step")


if __name__ == "__main__":
    model_dir = sys.argv[1]
    vocab = int(__import__("json").load(open(Path(model_dir) / "config.json"))["vocab_size"])
    semantics(vocab)
    engine_check(model_dir)
    timing(vocab)
