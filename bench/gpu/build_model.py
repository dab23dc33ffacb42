"""Build a ~1.1B-parameter Llama-style model with random weights (bf16) on the GPU machine.

    python3 bench/gpu/build_model.py TOKENIZER_DIR OUT_DIR

Llama-3.2-1B's shapes with the bundled SmolLM2 tokenizer (copied beside the weights); random
weights generate gibberish, so benchmarks use fixed lengths.
"""

import argparse
import shutil
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer_dir))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    started = time.perf_counter()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out_dir))
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(str(args.out_dir))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(args.tokenizer_dir / name, args.out_dir / name)
    elapsed = time.perf_counter() - started
    print(f"built {args.out_dir}: {params / 1e9:.3f}B parameters, vocab {config.vocab_size}, bf16, {elapsed:.1f} s")


if __name__ == "__main__":
    main()
