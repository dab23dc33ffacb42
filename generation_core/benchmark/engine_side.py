"""The engine side of `genrun bench`: each engine's own benchmark on the bench's requests, every
response run to the same length, as (generated tokens, seconds).

- `hf`: the model's static batch (`model.generate`, batches of rollout.max_num_seqs) in this
  process, torch threads as the engine's replica uses them;
- `remote`: the servers themselves, driven at genrun's concurrency (generation.max_inflight) by
  an async client posting the same `/v1/completions` bodies genrun sends;
- `sglang`: `sglang.Engine` in this process, with the settings verl's server gets (dtype,
  max_num_seqs as max_running_requests, engine_kwargs.sglang);
- `vllm`: `vllm.LLM.generate` in this process.

Every response runs to the bench's --tokens: ignore_eos (`min_new_tokens` for `hf`'s static batch).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any


def hf_static_batch(cfg, requests: list[list[int]], tokens: int) -> tuple[int, float]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from generation_core.config.engine_kwargs import HfEngineKwargs

    rollout = cfg.actor_rollout_ref.rollout
    hf = HfEngineKwargs.of(rollout.engine_kwargs)
    device = hf.device or "cpu"  # load_config has decided it (engine_kwargs.hf_device)
    dtype = getattr(torch, hf.dtype) if hf.dtype else (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    if not device.startswith("cuda"):
        torch.set_num_threads(hf.num_threads or os.cpu_count() or 1)
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.expanduser(cfg.actor_rollout_ref.model.path),
        dtype=dtype,
        trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code,
    ).to(device)  # type: ignore[arg-type]  # transformers types `to` as @wraps(nn.Module.to), whose first parameter is self
    model.eval()
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad[0] if isinstance(pad, list) else pad
    sample = rollout.temperature > 0
    options: dict[str, Any] = {
        "do_sample": sample,
        "max_new_tokens": tokens,
        "min_new_tokens": tokens,
        "pad_token_id": pad,
    }
    if sample:
        options.update(
            temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k if rollout.top_k > 0 else None
        )
    batch = rollout.max_num_seqs
    with torch.inference_mode():  # one untimed batch: first-call allocations, kernels
        warmup = torch.tensor([requests[0]], device=device)
        model.generate(
            input_ids=warmup,
            attention_mask=torch.ones_like(warmup),
            **dict(options, max_new_tokens=2, min_new_tokens=2),
        )
    started, generated = time.perf_counter(), 0
    for first in range(0, len(requests), batch):
        group = requests[first : first + batch]
        width = max(map(len, group))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, **options)
        generated += (out.shape[1] - width) * len(group)
    return generated, time.perf_counter() - started


def remote_direct(cfg, requests: list[list[int]], tokens: int) -> tuple[int, float]:
    import httpx

    from generation_core.config.layout import remote_settings, remote_urls
    from generation_core.config.settings import GenerationSettings
    from generation_core.engines.base import SamplingParams
    from generation_core.engines.remote import completion_request

    rollout = cfg.actor_rollout_ref.rollout
    settings = remote_settings(cfg)
    urls = remote_urls(cfg)
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    params = SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        logprobs=rollout.calculate_log_probs,
        ignore_eos=True,
    )

    async def drive() -> int:
        async with httpx.AsyncClient(timeout=None, headers=headers) as client:
            model = settings.model or (await client.get(f"{urls[0]}/v1/models")).json()["data"][0]["id"]
            gate = asyncio.Semaphore(GenerationSettings.of(cfg).inflight_limit)

            async def one(i: int, ids: list[int]) -> int:
                async with gate:
                    response = await client.post(
                        f"{urls[i % len(urls)]}/v1/completions", json=completion_request(model, ids, params, tokens)
                    )
                    response.raise_for_status()
                    return int(response.json()["usage"]["completion_tokens"])

            return sum(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(requests))))

    started = time.perf_counter()
    generated = asyncio.run(drive())
    return generated, time.perf_counter() - started


def sglang_offline(cfg, requests: list[list[int]], tokens: int) -> tuple[int, float]:
    import sglang

    rollout = cfg.actor_rollout_ref.rollout
    extra = dict(rollout.engine_kwargs.get("sglang") or {})
    engine = sglang.Engine(
        model_path=os.path.expanduser(cfg.actor_rollout_ref.model.path),
        dtype=rollout.dtype,
        skip_tokenizer_init=True,
        mem_fraction_static=rollout.gpu_memory_utilization,
        max_running_requests=rollout.max_num_seqs,
        tp_size=rollout.tensor_model_parallel_size,
        log_level="error",
        **extra,
    )
    params = {
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "max_new_tokens": tokens,
        "ignore_eos": True,
    }
    try:
        engine.generate(input_ids=requests[:8], sampling_params=dict(params, max_new_tokens=4))
        started = time.perf_counter()
        outputs = engine.generate(
            input_ids=requests, sampling_params=params, return_logprob=rollout.calculate_log_probs
        )
        seconds = time.perf_counter() - started
    finally:
        engine.shutdown()
    return sum(o["meta_info"]["completion_tokens"] for o in outputs), seconds


def vllm_offline(cfg, requests: list[list[int]], tokens: int) -> tuple[int, float]:
    import vllm

    rollout = cfg.actor_rollout_ref.rollout
    llm = vllm.LLM(
        model=os.path.expanduser(cfg.actor_rollout_ref.model.path),
        dtype=rollout.dtype,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        max_num_seqs=rollout.max_num_seqs,
        tensor_parallel_size=rollout.tensor_model_parallel_size,
        **dict(rollout.engine_kwargs.get("vllm") or {}),
    )
    params = vllm.SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_tokens=tokens,
        ignore_eos=True,
        logprobs=0 if rollout.calculate_log_probs else None,
    )
    prompts = [{"prompt_token_ids": ids} for ids in requests]
    llm.generate(prompts[:8], vllm.SamplingParams(max_tokens=4))
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs), time.perf_counter() - started


ENGINE_BENCHMARKS = {"hf": hf_static_batch, "remote": remote_direct, "sglang": sglang_offline, "vllm": vllm_offline}
ENGINE_SIDE = {
    "hf": "model.generate static batch",
    "remote": "the servers driven directly",
    "sglang": "sglang.Engine offline",
    "vllm": "vllm.LLM offline",
}
