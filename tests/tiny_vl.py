"""A tiny Qwen2.5-VL model folder, built offline for the multimodal tests.

Random weights from a small `Qwen2_5_VLConfig` (2 text layers, 2 vision blocks), the bundled
SmolLM2 tokenizer plus Qwen's vision special tokens, a ChatML template that emits them for
image and video parts, and `preprocessor_config.json` for transformers' PIL image processor
(56x56 to 112x112 pixels: 4 to 16 image tokens). Built once per test session (`tiny_vl_dir`).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_vl(folder: Path, tokenizer_dir: Path) -> Path:
    """Write a tiny Qwen2.5-VL model folder at `folder` from the tokenizer in `tokenizer_dir`."""
    import torch
    from transformers import (
        AutoTokenizer,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    start, end, image, video = tokenizer.convert_tokens_to_ids(VISION_TOKENS)
    special = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            tie_word_embeddings=True,
            **special,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        vision_start_token_id=start,
        vision_end_token_id=end,
        image_token_id=image,
        video_token_id=video,
        tie_word_embeddings=True,
        **special,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory, model_dir) -> Path:
    """The tiny Qwen2.5-VL folder of this test session."""
    return build_tiny_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"), Path(model_dir))


def png_bytes(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
