"""Image inputs in the layouts beside verl's `<image>` placeholders (docs/multimodal.md's Inputs):
dataset rows whose messages are content lists with `{"type": "image"}` parts, checked by the one
content rule (inputs/chat_content.py) and handed to verl's agent loop as the placeholder layout."""

from __future__ import annotations

import pytest

from tests.test_multimodal import _image_rows, _refusal
from tests.tiny_vl import png_bytes, tiny_vl_dir  # noqa: F401 - the session fixture

pytestmark = pytest.mark.timeout(240)

IMAGE_PART = {"type": "image", "text": None}
"""An image part as a Parquet file gives it back: the text parts' field, null."""


def _parts_rows(count: int) -> list[dict]:
    """`_image_rows` with each prompt a content list: the image part, then the text."""
    rows = _image_rows(count)
    for row in rows:
        text = row["prompt"][0]["content"].removeprefix("<image>")
        row["prompt"][0]["content"] = [{"type": "image"}, {"type": "text", "text": text}]
    return rows


def test_image_parts_pass_the_row_rule_only_with_as_many_images():
    from generation_core.inputs.chat_rows import placeholder_prompts, prompt_problem

    prompt = [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "What is it?"}]}]
    assert prompt_problem(prompt, 1) is None
    # A text-only model (no image count): the rule's words of before.
    assert prompt_problem(prompt, None) == (
        "[0].content[0] is a 'image' part; only text parts ({'type': 'text', 'text': ...}) are supported"
    )
    assert prompt_problem(prompt, 2) == (
        " has 1 image placeholder(s) (<image> in the text, or image parts) for 2 image(s) in 'images'; "
        "give one placeholder per image, in order"
    )
    assert prompt_problem(prompt, 0).startswith(
        " has 1 image placeholder(s) (<image> in the text, or image parts) for 0"
    )
    literal = [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "and <image>"}]}]
    assert "[0].content[1] holds '<image>' in its text beside image parts" in prompt_problem(literal, 1)
    inline = [{"role": "user", "content": [{"type": "image", "image": "cat.png"}]}]
    assert "[0].content[0] is an image part with its own 'image'" in prompt_problem(inline, 1)
    # A row without images whose text holds `<image>`: text, as before.
    assert prompt_problem([{"role": "user", "content": "a literal <image> tag"}], 0) is None
    assert placeholder_prompts([prompt]) == [[{"role": "user", "content": "<image>What is it?"}]]


def _shard_prompts(tmp_path, tiny_vl_dir, rows):  # noqa: F811
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.inputs.tokenizer import run_tokenizer
    from generation_core.preflight.preflight import preflight
    from tests.conftest import write_parquet

    plan = preflight(
        [
            f"data.train_files={write_parquet(tmp_path / 'prompts.parquet', rows)}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.model.path={tiny_vl_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
        ]
    )
    [shard] = plan.shards
    return DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, run_tokenizer(plan.cfg.actor_rollout_ref.model))


def _seen(raw_prompt) -> list:
    """The messages as verl's agent loop gets them, each image part's image as its pixels."""
    return [
        [
            {key: value.tobytes() if key == "image" else value for key, value in part.items()}
            for part in message["content"]
        ]
        for message in raw_prompt
    ]


def test_content_list_rows_reach_verls_agent_loop_as_the_placeholder_layout(tmp_path, tiny_vl_dir):  # noqa: F811
    parts = _shard_prompts(tmp_path / "parts", tiny_vl_dir, _parts_rows(2))
    placeholders = _shard_prompts(tmp_path / "placeholders", tiny_vl_dir, _image_rows(2))
    assert len(parts) == len(placeholders) == 2
    for position in range(2):
        ours, verls = parts.agent_kwargs(position)["raw_prompt"], placeholders.agent_kwargs(position)["raw_prompt"]
        assert [part["type"] for part in ours[0]["content"]] == ["image", "text"]
        assert _seen(ours) == _seen(verls)


def test_content_list_image_rows_are_refused_in_one_line(tmp_path, tiny_vl_dir, model_dir):  # noqa: F811
    text_only = [dict(row, images=None) for row in _parts_rows(1)]
    assert "prompt[0].content[0] is a 'image' part; only text parts" in _refusal(tmp_path, model_dir, text_only)
    literal = _parts_rows(1)
    literal[0]["prompt"][0]["content"][1]["text"] = "Is <image> a tag?"
    assert "row 0 (extra_info.index 0): prompt[0].content[1] holds '<image>' in its text beside image parts" in (
        _refusal(tmp_path, tiny_vl_dir, literal)
    )
    # Past the rows whose image cells preflight opens (media_columns.FIRST_ROWS), the row rule
    # still counts each row's images against its placeholders and image parts.
    late = [dict(row, extra_info={"split": "test", "index": i}) for i, row in enumerate(_image_rows(1) * 70)]
    late[66] = dict(late[66], prompt=[dict(late[66]["prompt"][0])])
    late[66]["prompt"][0]["content"] = "<image><image>" + late[66]["prompt"][0]["content"]
    assert "row 66 (extra_info.index 66): prompt has 3 image placeholder(s) (<image> in the text, or image parts) " in (
        _refusal(tmp_path, tiny_vl_dir, late)
    )
