"""After a sitting's genrun run: the run's figures, the merged DataProto's shape and a few decoded rows.

python3 bench/gpu/kit/show_output.py RUN_FOLDER MODEL_DIR OUT.json
"""

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer
    from verl.protocol import DataProto

    manifest = json.loads((args.folder / "manifest.json").read_text())
    data = DataProto.load_from_disk(str(args.folder / "trajectories.pkl"))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    mask = data.batch["response_mask"].bool()
    keys = ("num_trajectories", "generated_tokens", "failed_samples", "retries", "this_invocation")
    result = {
        "folder": str(args.folder),
        "summary": {key: manifest.get(key) for key in keys},
        "rows": len(data),
        "tensors": {key: list(value.shape) for key, value in data.batch.items()},
        "non_tensors": sorted(data.non_tensor_batch),
        "response_tokens": int(mask.sum()),
    }
    if "rollout_log_probs" in data.batch:
        logprobs = data.batch["rollout_log_probs"][mask]
        result["logprobs"] = {
            "finite": bool(torch.isfinite(logprobs).all()),
            "max": float(logprobs.max()),
            "mean": float(logprobs.mean()),
            # random (dummy) weights give every token -ln(vocab): a real checkpoint spreads them
            "min": float(logprobs.min()),
            "std": float(logprobs.std()),
        }
    prompt_width = data.batch["prompts"].shape[1]
    result["decoded"] = [
        {
            "prompt": tokenizer.decode(
                data.batch["prompts"][row][data.batch["attention_mask"][row][:prompt_width].bool()]
            )[-200:],
            "response": tokenizer.decode(data.batch["responses"][row][mask[row]])[:300],
        }
        for row in (0, 1, len(data) - 1)
    ]
    print(json.dumps(result, indent=1))
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
