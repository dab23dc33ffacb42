"""A vision-language model folder's processor for images where torchvision does not import.

transformers 5's Qwen2-VL-class processors need a video processor, which needs torchvision; the
registries' torchvision does not import beside the CPU torch, so verl's `hf_processor` gives None
for such a folder. `image_only_processor` builds the same processor class with transformers' PIL
image processor (`pil_image_processor`) and a stand-in that refuses videos in one line
(`VideoNeedsTorchvision`). inputs/tokenizer.run_processor is the one door to a folder's processor;
the transformers VL engine (engines/hf/vl.py) takes the image processor alone from here. No verl:
an engine's replica process imports this module.
"""

from __future__ import annotations

from typing import Any


class VideoNeedsTorchvision(ValueError):
    """A video given to a processor genrun built without a video processor (no torchvision here)."""


def model_type(folder: str, trust_remote_code: bool = False) -> tuple[str, bool]:
    """(config.json's model_type, whether the config has a vision part) of a model folder."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    return str(config.model_type), getattr(config, "vision_config", None) is not None


def pil_image_processor(folder: str, kind: str):
    """The PIL image processor transformers maps the model type `kind` to, from the folder's
    preprocessor_config.json; None for a model type without one."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(kind)
    if not isinstance(names, dict) or "pil" not in names:
        return None
    return getattr(transformers, names["pil"]).from_pretrained(folder)


def image_only_processor(folder: str, tokenizer, trust_remote_code: bool):
    """The processor class transformers maps the folder's model_type to, with the PIL image
    processor of preprocessor_config.json and a video stand-in that refuses videos; `config`
    and `get_rope_index` bound as verl's hf_processor binds them (the model class's method)."""
    import types

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    kind = config.model_type
    image_processor = pil_image_processor(folder, kind)
    processor_name = PROCESSOR_MAPPING_NAMES.get(kind)
    if image_processor is None or processor_name is None:
        return None
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
