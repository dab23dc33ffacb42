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


class VideoNeedsTorchvision(ValueError):
    """A video given to a processor genrun built without a video processor (no torchvision here)."""


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


def model_type(folder: str, trust_remote_code: bool = False) -> tuple[str, bool]:
    """(config.json's model_type, whether the config has a vision part) of a model folder."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return str(config.model_type), getattr(config, "vision_config", None) is not None


@functools.lru_cache(maxsize=4)
def _load_processor(folder: str, tokenizer_folder: str, trust_remote_code: bool, chat_template: str | None):
    import warnings

    from verl.utils import hf_processor

    with warnings.catch_warnings():
        # verl warns when it gives None: a text-only model, or the case handled below.
        warnings.simplefilter("ignore")
        processor = hf_processor(folder, trust_remote_code=trust_remote_code)
    if processor is None and model_type(folder, trust_remote_code)[1]:
        processor = _image_only_processor(folder, _load(tokenizer_folder, trust_remote_code, None), trust_remote_code)
    if processor is not None and chat_template is not None:
        processor.chat_template = chat_template
    return processor


def _image_only_processor(folder: str, tokenizer, trust_remote_code: bool):
    """The processor class transformers maps the folder's model_type to, with the PIL image
    processor of preprocessor_config.json and a video stand-in that refuses videos; `config`
    and `get_rope_index` bound as verl's hf_processor binds them (the model class's method)."""
    import types

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    kind = config.model_type
    image_names = IMAGE_PROCESSOR_MAPPING_NAMES.get(kind)
    processor_name = PROCESSOR_MAPPING_NAMES.get(kind)
    if not isinstance(image_names, dict) or "pil" not in image_names or processor_name is None:
        return None
    image_processor = getattr(transformers, image_names["pil"]).from_pretrained(folder)
    base = getattr(transformers, processor_name)
    # Same class name as transformers' (verl and readers look processors up by it), without its
    # check that the video processor is one: here it is a stand-in that refuses videos.
    image_only = type(base.__name__, (base,), {"check_argument_for_proper_class": _accept_video_stand_in})
    processor = image_only(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=_NoVideoProcessor(kind),
        chat_template=tokenizer.chat_template,
    )
    processor.config = config
    model_class = getattr(transformers, str(MODEL_MAPPING_NAMES.get(kind, "")), None)
    if model_class is not None and hasattr(model_class, "get_rope_index"):
        processor.get_rope_index = types.MethodType(model_class.get_rope_index, processor)
        if hasattr(model_class, "get_vision_position_ids"):
            processor.get_vision_position_ids = types.MethodType(model_class.get_vision_position_ids, processor)
    return processor


def _accept_video_stand_in(self, argument_name, argument):
    if isinstance(argument, _NoVideoProcessor):
        return type(argument)
    return super(type(self), self).check_argument_for_proper_class(argument_name, argument)


class _NoVideoProcessor:
    """Stands in for a VL processor's video processor where torchvision cannot be imported."""

    merge_size = 2

    def __init__(self, kind: str):
        self.kind = kind

    def to_dict(self) -> dict[str, Any]:
        # What the processor's own repr and save_pretrained write for it.
        return {"video_processor": None}

    def __call__(self, *_args: Any, **_kwargs: Any) -> Any:
        raise VideoNeedsTorchvision(
            f"a {self.kind} video needs transformers' video processor, which needs torchvision, and torchvision "
            "does not import on this machine: install a torchvision built for this torch, or give images only"
        )
