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
    from tests.conftest import write_parquet

    return _shard_prompts_of(tmp_path, tiny_vl_dir, write_parquet(tmp_path / "prompts.parquet", rows))


def _shard_prompts_of(tmp_path, tiny_vl_dir, data_file):  # noqa: F811
    """The one shard's prompts of a preflight over `data_file` with the tiny VL model."""
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.inputs.tokenizer import run_tokenizer
    from generation_core.preflight.preflight import preflight

    plan = preflight(
        [
            f"data.train_files={data_file}",
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


def _image_line(custom_id: str, *urls: str, text: str = "What is in it?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]},
    }


def _text_line(custom_id: str) -> dict:
    return {**_image_line(custom_id), "body": {"messages": [{"role": "user", "content": "No picture."}]}}


def _jsonl(lines: list[dict]) -> bytes:
    import json

    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def test_batch_image_url_parts_become_the_rows_images(tmp_path, tiny_vl_dir):  # noqa: F811
    import base64

    from generation_core.inputs.batch_images import IMAGES
    from generation_core.inputs.openai_batch import SCHEMA, BatchLimits, batch_table

    first, second = png_bytes(120, 90, seed=1), png_bytes(100, 90, seed=2)
    (tmp_path / "second.png").write_bytes(second)
    data_url = "data:image/png;base64," + base64.b64encode(first).decode()
    content = _jsonl(
        [
            _image_line("a", data_url),
            _image_line("b", f"file://{tmp_path / 'second.png'}", str(tmp_path / "second.png"), text="Compare."),
            _text_line("c"),
        ]
    )
    limits = BatchLimits(n=1, response_length=16, calculate_log_probs=False, model=str(tiny_vl_dir))
    table = batch_table(str(tmp_path / "in.jsonl"), content, limits)
    assert table.schema.field("images").type == IMAGES
    rows = table.to_pylist()
    assert [row["prompt"][0]["content"] for row in rows] == [
        "<image>What is in it?",
        "<image><image>Compare.",
        "No picture.",
    ]
    assert [row["images"] for row in rows] == [[{"bytes": first}], [{"bytes": second}] * 2, []]
    # A file without image parts keeps the schema of before (its fingerprint does not move).
    assert batch_table("t.jsonl", _jsonl([_text_line("c")]), limits).schema == SCHEMA


def test_batch_image_url_parts_are_refused_by_line(tmp_path, tiny_vl_dir, model_dir):  # noqa: F811
    import base64

    from generation_core.errors import GenrunError
    from generation_core.inputs.openai_batch import BatchLimits, batch_table

    good = "data:image/png;base64," + base64.b64encode(png_bytes(120, 90)).decode()
    text_only = BatchLimits(n=1, response_length=16, calculate_log_probs=False, model=str(model_dir))
    with pytest.raises(GenrunError) as refused:
        batch_table("in.jsonl", _jsonl([_image_line("a", good)]), text_only)
    assert str(refused.value) == (
        "OpenAI batch file in.jsonl: 1 bad line(s): line 1 (custom_id 'a'): body.messages[0].content has image_url "
        f"parts, and the model {model_dir} is a text-only llama model: images need a vision-language model "
        "(e.g. Qwen2.5-VL); set actor_rollout_ref.model.path to one, or remove them; fix or remove them"
    )
    vision = BatchLimits(n=1, response_length=16, calculate_log_probs=False, model=str(tiny_vl_dir))
    lines = [
        _image_line("fine", good),
        _image_line("junk", "data:image/png;base64," + base64.b64encode(b"not an image").decode()),
        _image_line("plain", "data:image/png,rawbytes"),
        _image_line("gone", f"file://{tmp_path / 'gone.png'}"),
        _image_line("extra", good, text="and <image>"),
        {
            **_image_line("split", good),
            "body": {
                "messages": [{"role": "system", "content": "<image>"}, _image_line("", good)["body"]["messages"][0]]
            },
        },
    ]
    with pytest.raises(GenrunError) as refused:
        batch_table("in.jsonl", _jsonl(lines), vision)
    message = str(refused.value)
    assert "\n" not in message and "base64,iVBOR" not in message
    assert message.startswith("OpenAI batch file in.jsonl: 5 bad line(s): line 2 (custom_id 'junk'): ")
    assert (
        "line 2 (custom_id 'junk'): body.messages[0].content[0].image_url: its data URL is not an image PIL" in message
    )
    assert (
        "line 3 (custom_id 'plain'): body.messages[0].content[0].image_url: its data URL does not read "
        "(ValueError: a data: image URL must be base64" in message
    )
    assert (
        f"line 4 (custom_id 'gone'): body.messages[0].content[0].image_url: 'file://{tmp_path / 'gone.png'}' does not read (FileNotFoundError"
        in message
    )
    assert (
        "line 5 (custom_id 'extra'): body.messages[0].content[1] holds '<image>' in its text beside image parts"
        in message
    )
    assert (
        "line 6 (custom_id 'split'): body.messages hold 1 '<image>' in their text beside 1 image_url part(s), which "
        "verl would read as more images; remove it from the text; fix or remove them"
    ) in message


def test_batch_image_rows_reach_verls_agent_loop_with_their_images(tmp_path, tiny_vl_dir):  # noqa: F811
    import base64

    from generation_core.inputs.images import open_png

    image = png_bytes(120, 90, seed=3)
    batch = tmp_path / "in.jsonl"
    batch.write_bytes(_jsonl([_image_line("a", "data:image/png;base64," + base64.b64encode(image).decode())]))
    prompts = _shard_prompts_of(tmp_path, tiny_vl_dir, batch)
    [message] = prompts.agent_kwargs(0)["raw_prompt"]
    assert [part["type"] for part in message["content"]] == ["image", "text"]
    assert message["content"][0]["image"].convert("RGB").tobytes() == open_png(image).convert("RGB").tobytes()
