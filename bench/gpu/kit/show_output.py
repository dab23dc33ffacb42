"""After a sitting's genrun run: the run's figures, the merged DataProto's shape and a few decoded rows.

python3 bench/gpu/kit/show_output.py RUN_FOLDER MODEL_DIR OUT.json
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer
from verl.protocol import DataProto

folder, model, out = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
manifest = json.loads((folder / "manifest.json").read_text())
data = DataProto.load_from_disk(str(folder / "trajectories.pkl"))
tokenizer = AutoTokenizer.from_pretrained(model)
shapes = {key: list(value.shape) for key, value in data.batch.items()}
mask = data.batch["response_mask"].bool()
result = {
    "folder": str(folder),
    "summary": {
        key: manifest.get(key)
        for key in ("num_trajectories", "generated_tokens", "failed_samples", "retries", "this_invocation")
    },
    "rows": len(data),
    "tensors": shapes,
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
result["decoded"] = [
    {
        "prompt": tokenizer.decode(
            data.batch["prompts"][row][data.batch["attention_mask"][row][: data.batch["prompts"].shape[1]].bool()]
        )[-200:],
        "response": tokenizer.decode(data.batch["responses"][row][mask[row]])[:300],
    }
    for row in (0, 1, len(data) - 1)
]
print(json.dumps(result, indent=1))
Path(out).write_text(json.dumps(result, indent=1))
