"""`genrun bench`: how much of the engine's own throughput survives the pipeline, in one sitting.

    genrun bench [--sittings 3] [--prompts 64] [--tokens 32] [--json OUT] [--keep] [--report] [key=value ...]

Each sitting runs, on the same prompts, rollout.n and response length, the engine's own offline
benchmark and then a whole `genrun` run (Prefect flow, Ray, shard tasks, agent loops, parts,
merge), and prints tokens/s of each and genrun/engine. Machines are noisy (bench/RESULTS.md: the
same run gave 1.06 and 0.81 in two sittings), so the answer is the median and the spread over
sittings, not one number. The engine comes from the overrides (`actor_rollout_ref.rollout.name`):

- `hf`: the model's static batch (`model.generate`, batches of rollout.max_num_seqs) in this
  process, torch threads as the engine's replica uses them;
- `remote`: the servers themselves, driven at genrun's concurrency (generation.max_inflight) by
  an async client posting the same `/v1/completions` bodies genrun sends;
- `sglang`: `sglang.Engine` in this process, with the settings verl's server gets (dtype,
  max_num_seqs as max_running_requests, engine_kwargs.sglang);
- `vllm`: `vllm.LLM.generate` in this process.

Lengths: every response runs to --tokens on both sides: the engine side asks for ignore_eos
(`min_new_tokens` for `hf`'s static batch), and the genrun run sets verl's
`actor_rollout_ref.rollout.ignore_eos=true`, which genrun sends with every request.

genrun's figure is its generation phase, as bench/pipeline_efficiency.py defines it: tokens over
(first shard worker ready with the engine up -> last shard done), from the run's timeline
(generation_core/instrumentation.py); startup and merge are reported beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from generation_core.errors import GenrunError

USAGE = "usage: genrun bench [--sittings N] [--prompts N] [--tokens N] [--json OUT] [--keep] [--report] [key=value ...]"


@dataclass
class Sitting:
    engine_tokens: int
    engine_seconds: float
    genrun_tokens: int
    genrun_generation_seconds: float
    genrun_wall_seconds: float

    @property
    def engine_rate(self) -> float:
        return self.engine_tokens / self.engine_seconds

    @property
    def genrun_rate(self) -> float:
        return self.genrun_tokens / self.genrun_generation_seconds

    @property
    def ratio(self) -> float:
        return self.genrun_rate / self.engine_rate


class _Arguments(argparse.ArgumentParser):
    def error(self, message: str):  # one GenrunError line, not argparse's exit
        raise GenrunError(f"{message}; {USAGE}")


def parse_bench_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = _Arguments(prog="genrun bench", add_help=False)
    parser.add_argument("--sittings", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (the runs' folders and logs)")
    parser.add_argument(
        "--report",
        action="store_true",
        help="the figures into the last sitting's run report (keeps the scratch folder)",
    )
    args, overrides = parser.parse_known_args(argv)
    unknown = [item for item in overrides if item.startswith("-")]
    if unknown:
        raise GenrunError(f"unknown option {unknown[0]}; {USAGE}")
    for name in ("sittings", "prompts", "tokens"):
        if getattr(args, name) < 1:
            raise GenrunError(f"--{name} must be an integer >= 1, got {getattr(args, name)}")
    owned = [item for item in overrides if _key(item) in ("data.max_response_length", "trainer.default_local_dir")]
    if owned:
        raise GenrunError(f"{_key(owned[0])} is set by the bench (--tokens, its scratch folder); leave it out")
    return args, overrides


def _key(override: str) -> str:
    return override.lstrip("+").split("=")[0]


def write_prompts(source_files: list[str], out: Path, count: int, prompt_key: str) -> None:
    """The first `count` rows of the run's dataset (cycled when it has fewer), each with its own index."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(source_files[0]).to_pylist()
    if not rows or prompt_key not in rows[0]:
        raise GenrunError(f"{source_files[0]} has no rows with a {prompt_key!r} column to benchmark on")
    chosen = []
    for i in range(count):
        row = dict(rows[i % len(rows)])
        row["extra_info"] = dict(row.get("extra_info") or {}, index=i)
        chosen.append(row)
    pq.write_table(pa.Table.from_pylist(chosen), out)


def prompt_ids(cfg, prompts_file: Path) -> list[list[int]]:
    """The prompts as genrun's agent loop tokenizes them: the chat template, generation prompt added."""
    import pyarrow.parquet as pq
    from verl.utils import hf_tokenizer

    model = cfg.actor_rollout_ref.model
    tokenizer = hf_tokenizer(
        os.path.expanduser(model.get("tokenizer_path") or model.path), trust_remote_code=model.trust_remote_code
    )
    chats = pq.read_table(prompts_file, columns=[cfg.data.prompt_key]).column(0).to_pylist()
    return [
        list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
        for chat in chats
    ]


# ---- the engines' own benchmarks: (generated tokens, seconds) -------------------------------


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


# ---- genrun's side -------------------------------------------------------------------------


def genrun_run(
    overrides: list[str], prompts_file: Path, tokens: int, folder: Path, engine: str
) -> tuple[int, float, float]:
    """(generated tokens, generation-phase seconds, wall seconds) of one whole `genrun` run."""
    from generation_core.instrumentation import TIMELINE_ENV, generation_phase_seconds, read_timeline

    timeline = folder.with_suffix(".timeline")
    env = dict(os.environ, **{TIMELINE_ENV: str(timeline)})
    env.pop("PREFECT_API_URL", None)  # its own temporary server, as a user's first run
    # The bench's subset of the dataset stands in for data.train_files (the source of its prompts).
    overrides = [item for item in overrides if _key(item) != "data.train_files"]
    fixed = [
        f"data.train_files={prompts_file}",
        f"data.max_response_length={tokens}",
        f"trainer.default_local_dir={folder}",
        "generation.show_progress=false",
    ]
    # Every response runs to --tokens, as on the engine side (every engine honours it).
    fixed.append("actor_rollout_ref.rollout.ignore_eos=true")
    log = folder.with_suffix(".log")
    started = time.perf_counter()
    with log.open("w") as out:
        finished = subprocess.run(
            [sys.executable, "-m", "flows.cli", *overrides, *fixed], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    wall = time.perf_counter() - started
    if finished.returncode != 0:
        tail = log.read_text()[-2000:]
        raise GenrunError(f"the genrun run of the bench failed (exit {finished.returncode}); its log: {log}\n{tail}")
    manifest = json.loads((folder / "manifest.json").read_text())
    return int(manifest["generated_tokens"]), generation_phase_seconds(read_timeline(timeline)), wall


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3), "max": round(max(values), 3)}


def bench_command(argv: list[str]) -> int:
    from generation_core.preflight.preflight import preflight

    args, overrides = parse_bench_arguments(argv)
    plan = preflight(overrides)  # every input check first, as a run does
    cfg = plan.cfg
    engine = cfg.actor_rollout_ref.rollout.name
    if engine not in ENGINE_BENCHMARKS:
        raise GenrunError(
            f"genrun bench has no engine-side benchmark for rollout.name={engine}; it measures {', '.join(ENGINE_BENCHMARKS)}"
        )
    scratch = Path(tempfile.mkdtemp(prefix="genrun-bench-"))
    prompts_file = scratch / "prompts.parquet"
    from generation_core.config.loading import train_files

    write_prompts(train_files(cfg), prompts_file, args.prompts, cfg.data.prompt_key)
    requests = [ids for ids in prompt_ids(cfg, prompts_file) for _ in range(cfg.actor_rollout_ref.rollout.n)]
    print(
        f"genrun bench: {engine}, {args.prompts} prompts x n={cfg.actor_rollout_ref.rollout.n} = {len(requests)} requests, "
        f"{args.tokens} tokens each, {args.sittings} sitting(s); engine side: {ENGINE_SIDE[engine]}; scratch: {scratch}",
        flush=True,
    )
    sittings = []
    for number in range(1, args.sittings + 1):
        engine_tokens, engine_seconds = ENGINE_BENCHMARKS[engine](cfg, requests, args.tokens)
        tokens, generation_seconds, wall = genrun_run(
            overrides, prompts_file, args.tokens, scratch / f"sitting-{number}", engine
        )
        sitting = Sitting(engine_tokens, engine_seconds, tokens, generation_seconds, wall)
        sittings.append(sitting)
        print(
            f"  sitting {number}: engine {sitting.engine_rate:.1f} tokens/s ({engine_tokens} tokens in {engine_seconds:.1f} s); "
            f"genrun {sitting.genrun_rate:.1f} tokens/s ({tokens} tokens in a {generation_seconds:.1f} s generation phase, "
            f"{wall:.1f} s whole command); genrun/engine {sitting.ratio:.2f}",
            flush=True,
        )
    ratios = [s.ratio for s in sittings]
    result = {
        "engine": engine,
        "engine_side": ENGINE_SIDE[engine],
        "model": cfg.actor_rollout_ref.model.path,
        "prompts": args.prompts,
        "n": cfg.actor_rollout_ref.rollout.n,
        "tokens": args.tokens,
        "requests": len(requests),
        "sittings": [
            dict(
                asdict(s),
                engine_tokens_per_s=round(s.engine_rate, 2),
                genrun_tokens_per_s=round(s.genrun_rate, 2),
                ratio=round(s.ratio, 4),
            )
            for s in sittings
        ],
        "ratio": spread(ratios),
        "engine_tokens_per_s": spread([s.engine_rate for s in sittings]),
        "genrun_tokens_per_s": spread([s.genrun_rate for s in sittings]),
    }
    print(
        f"genrun/engine: median {result['ratio']['median']:.2f} (min {result['ratio']['min']:.2f}, max {result['ratio']['max']:.2f}) over {len(sittings)} sitting(s)"
    )
    _write_figures(args, result, scratch)
    return 0


def _write_figures(args: argparse.Namespace, result: dict[str, Any], scratch: Path) -> None:
    """The figures as JSON (--json, else into the scratch folder); with --report also into the
    last sitting's run folder, whose report.html then shows them; the scratch folder goes unless
    it holds the only copy (no --json), or --keep or --report keep it."""
    out = Path(args.json) if args.json else scratch / "bench.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"written: {out}")
    if args.report:
        from generation_core.report.html import write_report
        from generation_core.store.folder import StorageFolder
        from generation_core.store.run_folder import BENCH_FILE

        run_folder = StorageFolder(str(scratch / f"sitting-{args.sittings}"))
        run_folder.put_json(BENCH_FILE, result)
        print(f"report: {write_report(run_folder).location} (the last sitting's run, with the bench's figures)")
    if args.json and not (args.keep or args.report):
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    elif args.keep or args.report:
        print(f"kept: {scratch} (the runs' folders, logs and timelines)")
