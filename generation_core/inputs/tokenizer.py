"""The run's tokenizer, by verl's rule, for every place genrun tokenizes or decodes on its own.

verl's agent loops tokenize the prompts with `HFModelConfig.tokenizer`: the folder
`actor_rollout_ref.model.tokenizer_path` names, else the model's `path`, with the model's
`custom_chat_template` in place of the folder's when one is set. genrun's own readers (the
preflight's overlong-prompt check and pad id, a shard's prompt filter and reward decoding, the
first example shown at the end, bench, export, the report's viewer) follow the same rule here,
so a prompt is measured, filtered and decoded by the tokenizer that made its ids.

Light to import: verl (and with it torch) loads only when a tokenizer is loaded.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from generation_core.inputs.vl_processor import image_only_processor, model_type


def tokenizer_dir(model: Mapping[str, Any]) -> str:
    """The folder of the run's tokenizer: `tokenizer_path`, else the model's `path` (`~` expanded).
    `model`: the run's `actor_rollout_ref.model` (a DictConfig, or run.json's dict)."""
    return os.path.expanduser(str(model.get("tokenizer_path") or model["path"]))


def run_tokenizer(model: Mapping[str, Any], *, trust_remote_code: bool | None = None):
    """The run's tokenizer (verl's `hf_tokenizer`: its pad-token fallback, so padding matches
    verl's), loaded once per process for the same folder and settings (a Ray worker runs many
    shards). `trust_remote_code`: the model config's own unless given (export and report take
    the user's command-line choice instead: reading a folder runs no code it names)."""
    trusted = bool(model.get("trust_remote_code", False)) if trust_remote_code is None else trust_remote_code
    template = model.get("custom_chat_template")
    return _load(tokenizer_dir(model), trusted, None if template is None else str(template))


@functools.lru_cache(maxsize=4)
def _load(folder: str, trust_remote_code: bool, chat_template: str | None):
    from verl.utils import hf_tokenizer

    tokenizer = hf_tokenizer(folder, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def run_processor(model: Mapping[str, Any], *, trust_remote_code: bool | None = None):
    """The run's multimodal processor, or None for a text-only model: verl's `hf_processor` of the
    model's folder (the tokenizer's folder rule, `custom_chat_template` on it too), loaded once
    per process. Where verl's returns None for a vision-language folder because transformers'
    video processor needs torchvision and this machine has none that imports, the same
    processor class is built with its PIL image processor and no video processor: images work,
    a video raises `VideoNeedsTorchvision` (one line)."""
    trusted = bool(model.get("trust_remote_code", False)) if trust_remote_code is None else trust_remote_code
    template = model.get("custom_chat_template")
    return _load_processor(
        os.path.expanduser(str(model["path"])),
        tokenizer_dir(model),
        trusted,
        None if template is None else str(template),
    )


@functools.lru_cache(maxsize=4)
def _load_processor(folder: str, tokenizer_folder: str, trust_remote_code: bool, chat_template: str | None):
    import warnings

    from verl.utils import hf_processor

    with warnings.catch_warnings():
        # verl warns when it gives None: a text-only model, or the case handled below.
        warnings.simplefilter("ignore")
        processor = hf_processor(folder, trust_remote_code=trust_remote_code)
    if processor is None and model_type(folder, trust_remote_code)[1]:
        processor = image_only_processor(folder, _load(tokenizer_folder, trust_remote_code, None), trust_remote_code)
    if processor is not None and chat_template is not None:
        processor.chat_template = chat_template
    return processor
