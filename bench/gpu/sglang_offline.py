"""SGLang's own offline throughput on genrun's prompts: the engine side of genrun/engine on a GPU.

    python3 bench/gpu/sglang_offline.py MODEL_DIR PROMPTS.parquet --n 4 --max-new-tokens 128 --json OUT.json
    python3 bench/gpu/sglang_offline.py --make-prompts OUT.parquet --repeat 11   # 48 bundled prompts x 11

`sglang.Engine` in this process (no HTTP, Ray or agent loop) with the settings the genrun run of the
same sitting gives verl's SGLang server (chat template, n copies, temperature 1, logprobs, triton
attention, PyTorch sampling). Every request is submitted at once twice: cold, straight after the
boot, as a genrun run meets its replica (the pass to compare with genrun: bench/gpu/README.md), then
warm. Prints and writes requests, tokens, seconds and tokens/s of each pass, the boot, the version.
"""

import argparse
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq


def make_prompts(source: str, out: str, repeat: int) -> None:
    table = pq.read_table(source)
    rows = table.to_pylist()
    copies = []
    for copy in range(repeat):
        for row in rows:
            row = dict(row, extra_info=dict(row["extra_info"], index=copy * len(rows) + row["extra_info"]["index"]))
            copies.append(row)
    pq.write_table(pa.Table.from_pylist(copies, schema=table.schema), out)
    print(f"{len(copies)} prompts -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?")
    parser.add_argument("prompts", nargs="?")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    # As engine_kwargs.sglang.disable_piecewise_cuda_graph=true of the genrun run: a shorter boot.
    parser.add_argument("--no-piecewise-cuda-graph", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--make-prompts")
    parser.add_argument("--repeat", type=int, default=11)
    args = parser.parse_args()
    if args.make_prompts:
        make_prompts("generation_core/config/demo_prompts.parquet", args.make_prompts, args.repeat)
        return

    import sglang
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    messages = pq.read_table(args.prompts, columns=["prompt"]).column("prompt").to_pylist()
    prompt_ids = [
        tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False) for m in messages
    ]
    requests = [ids for ids in prompt_ids for _ in range(args.n)]
    params = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens, "ignore_eos": False}
    started = time.perf_counter()
    # bfloat16 and max_running_requests as verl's server gets them (rollout.dtype, max_num_seqs): the
    # bundled SmolLM2 directory is float32, and with dtype auto the first sitting's run did not finish in 120 s.
    engine = sglang.Engine(
        model_path=args.model,
        dtype="bfloat16",
        attention_backend="triton",
        sampling_backend="pytorch",
        skip_tokenizer_init=True,
        mem_fraction_static=0.8,  # as rollout.gpu_memory_utilization of the genrun run
        max_running_requests=512,  # as rollout.max_num_seqs
        disable_piecewise_cuda_graph=args.no_piecewise_cuda_graph,
        random_seed=0,
        log_level="error",
    )
    boot = time.perf_counter() - started
    passes = {}
    for name in ("cold", "warm"):
        started = time.perf_counter()
        outputs = engine.generate(input_ids=requests, sampling_params=params, return_logprob=True)
        wall = time.perf_counter() - started
        tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
        logprobs = sum(len(o["meta_info"].get("output_token_logprobs") or []) for o in outputs)
        passes[name] = {
            "generated_tokens": tokens,
            "logprobs_returned": logprobs,
            "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
        }
    engine.shutdown()
    result = {
        "engine": f"sglang {sglang.__version__}",
        "model": args.model,
        "requests": len(requests),
        "prompt_tokens_mean": sum(map(len, prompt_ids)) / len(prompt_ids),
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": False,
        **passes["warm"],
        "cold": passes["cold"],
        "boot_s": round(boot, 1),
    }
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
