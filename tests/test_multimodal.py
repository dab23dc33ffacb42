"""Images in, trajectories out (docs/multimodal.md): the processor of a vision-language model
folder without torchvision, verl's input layout through verl's agent loop, and the merged
DataProto's multimodal fields equal to verl's own postprocess."""

from __future__ import annotations

import io

import pytest

from tests.tiny_vl import png_bytes, tiny_vl_dir  # noqa: F401 - the session fixture

pytestmark = pytest.mark.timeout(240)


def test_processor_of_a_vl_folder_without_torchvision(tiny_vl_dir):  # noqa: F811
    """verl's hf_processor gives None for the folder here (transformers' video processor needs
    torchvision); genrun's has the PIL image processor, verl's get_rope_index binding, and one
    line for a video."""
    import numpy as np
    from PIL import Image
    from verl.utils import hf_processor

    from generation_core.inputs.tokenizer import VideoNeedsTorchvision, run_processor

    assert hf_processor(str(tiny_vl_dir)) is None
    processor = run_processor({"path": str(tiny_vl_dir)})
    assert type(processor).__name__ == "Qwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    image = Image.open(io.BytesIO(png_bytes(120, 90)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    # 112x84 after the resize to the 56..112 pixel box: a 8x6 patch grid, 12 tokens after the 2x2 merge.
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 8]]
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 12
    positions, _ = processor.get_rope_index(
        input_ids=inputs["input_ids"],
        attention_mask=inputs["attention_mask"],
        image_grid_thw=inputs["image_grid_thw"],
        mm_token_type_ids=(inputs["input_ids"] == processor.image_token_id).long(),
    )
    assert positions.shape == (3, 1, inputs["input_ids"].shape[1])
    with pytest.raises(VideoNeedsTorchvision, match="needs torchvision"):
        processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[np.zeros((2, 28, 28, 3), "uint8")])


def test_text_only_folder_has_no_processor(model_dir):
    from generation_core.inputs.tokenizer import run_processor

    assert run_processor({"path": str(model_dir)}) is None
