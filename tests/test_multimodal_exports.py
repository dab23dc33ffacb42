"""Images out (docs/multimodal.md): the SFT export of an image run in TRL's vision-language layout,
the rl-prompts export in verl's (read back through genrun's own input path), and the report's
viewer showing each trajectory's images within a bounded page."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.test_multimodal import _image_rows, _instant_image_run
from tests.tiny_vl import png_bytes, tiny_vl_dir  # noqa: F401 - the session fixture

pytestmark = pytest.mark.timeout(240)

REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
    "    return float(extra_info['index'] != 1)\n"
)


@pytest.fixture(scope="module")
def image_run(tmp_path_factory, tiny_vl_dir):  # noqa: F811
    """3 prompts x n=2 on the instant engine, each with one image named by path (verl's layout),
    scored 1 but for prompt 1; returns (run folder, the input rows, the stored images by index)."""
    from generation_core.store.part_repair import committed_parts, read_verified_part
    from generation_core.store.trajectory_record import records_from_parquet

    base = tmp_path_factory.mktemp("image-run")
    rows = _image_rows(3)
    for i, row in enumerate(rows):
        (base / f"picture{i}.png").write_bytes(row["images"][0]["bytes"])
        row["images"] = [{"path": str(base / f"picture{i}.png")}]
    (base / "reward.py").write_text(REWARD)
    plan, _ = _instant_image_run(
        base, tiny_vl_dir, rows, overrides=[f"reward.custom_reward_function.path={base / 'reward.py'}"], scored=True
    )
    stored = {
        record.index: record.images
        for part in committed_parts(plan.folder)
        for record in records_from_parquet(read_verified_part(plan.folder, part))
    }
    return base / "run", rows, stored


def test_the_sft_export_of_an_image_run_is_trls_vision_layout(image_run, tmp_path):
    """messages with `{"type": "image"}` parts where the images were and text parts elsewhere, an
    `images` column of the PNGs the model saw, declared as `datasets` Image features."""
    from generation_core.exports.export import ExportOptions, export_run
    from generation_core.inputs.images import open_png

    run, _, stored = image_run
    summary = export_run(str(run), str(tmp_path / "sft.parquet"), ExportOptions())
    assert summary.rows == 6
    table = pq.read_table(tmp_path / "sft.parquet")
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features == {"images": {"_type": "Sequence", "feature": {"_type": "Image"}}}
    first = table.slice(0, 1).to_pylist()[0]
    assert first["messages"][0] == {
        "role": "user",
        "content": [{"type": "image", "text": None}, {"type": "text", "text": "What is in picture 0?"}],
    }
    assert first["messages"][1]["role"] == "assistant"
    assert [part["type"] for part in first["messages"][1]["content"]] == ["text"]
    assert [len(cell) for cell in table.column("images").to_pylist()] == [1] * 6
    assert [row["images"][0]["bytes"] for row in table.to_pylist()] == [stored[i][0] for i in (0, 0, 1, 1, 2, 2)]
    assert open_png(first["images"][0]["bytes"]).size == (112, 84)
    # The prompt-completion layout carries the same parts and images.
    export_run(str(run), str(tmp_path / "pc.parquet"), ExportOptions(layout="prompt-completion"))
    pc = pq.read_table(tmp_path / "pc.parquet").to_pylist()[0]
    assert pc["prompt"] == first["messages"][:1] and pc["completion"] == first["messages"][1:]
    assert pc["images"] == first["images"]


def test_the_sft_image_export_loads_as_pil_images_for_trl(image_run, tmp_path, tiny_vl_dir):  # noqa: F811
    """`datasets` (what TRL's SFTTrainer reads) gives the `images` cells as PIL images, and TRL's
    vision-language collator turns the rows into the model's inputs with the run's processor."""
    datasets = pytest.importorskip("datasets")
    collators = pytest.importorskip("trl.trainer.sft_trainer")
    from generation_core.exports.export import ExportOptions, export_run
    from generation_core.inputs.tokenizer import run_processor

    run, _, _ = image_run
    processor = run_processor({"path": str(tiny_vl_dir)})
    for layout in ("messages", "prompt-completion"):
        export_run(str(run), str(tmp_path / f"{layout}.parquet"), ExportOptions(layout=layout))
        loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / f"{layout}.parquet"), split="train")
        image = loaded[0]["images"][0]
        assert type(image).__name__ == "PngImageFile" and image.size == (112, 84)
        collator = collators.DataCollatorForVisionLanguageModeling(
            processor, completion_only_loss=layout == "prompt-completion"
        )
        batch = collator([loaded[0], loaded[2]])
        # 112x84: a 6x8 patch grid, 12 image tokens after the 2x2 merge, one image per row.
        assert batch["image_grid_thw"].tolist() == [[1, 6, 8]] * 2
        assert (batch["input_ids"] == processor.image_token_id).sum(dim=1).tolist() == [12, 12]


def test_the_rl_prompts_export_of_an_image_run_reads_back_as_genruns_input(image_run, tmp_path, tiny_vl_dir):  # noqa: F811
    """verl's layout, each image as `{"bytes": ...}` in the file (a path cell read in): the export
    given as data.train_files passes genrun's input checks and its rows carry the same images."""
    from generation_core.exports.export import ExportOptions
    from generation_core.exports.rl_prompts import export_prompts
    from generation_core.inputs.images import open_png, vision_info
    from generation_core.inputs.images import png_bytes as image_png
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.inputs.tokenizer import run_tokenizer
    from generation_core.preflight.preflight import preflight

    run, rows, stored = image_run
    out = tmp_path / "rl.parquet"
    summary = export_prompts(str(run), str(out), ExportOptions(layout="rl-prompts", pass_rate=(0.5, 1.0)))
    assert summary.rows == 2
    exported = pq.read_table(out).to_pylist()
    assert [row["extra_info"]["index"] for row in exported] == [0, 2]
    assert [row["prompt"][0]["content"] for row in exported] == [
        "<image>What is in picture 0?",
        "<image>What is in picture 2?",
    ]
    for row in exported:
        [cell] = row["images"]
        assert set(cell) == {"bytes"}
        assert cell["bytes"] == open(rows[row["extra_info"]["index"]]["images"][0]["path"], "rb").read()
    plan = preflight(
        [
            f"data.train_files={out}",
            f"trainer.default_local_dir={tmp_path / 'again'}",
            f"actor_rollout_ref.model.path={tiny_vl_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
        ]
    )
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, run_tokenizer(plan.cfg.actor_rollout_ref.model))
    assert len(prompts) == 2
    for position, index in enumerate((0, 2)):
        images, _ = vision_info(prompts.agent_kwargs(position)["raw_prompt"])
        assert [image_png(image) for image in images] == stored[index]
        assert open_png(stored[index][0]).size == images[0].size


def test_the_viewer_shows_each_trajectorys_images_within_its_budget(image_run):
    """Each sampled trajectory names its image's thumbnail, each distinct image is in the page once,
    and past the budget a trajectory says how many it does not show."""
    from generation_core.report import viewer
    from generation_core.report.data import collect_report_data
    from generation_core.report.viewer import IMAGE_BUDGET, viewer_payload
    from generation_core.store.folder import StorageFolder
    from generation_core.store.run_folder import read_run_record

    run, _, _ = image_run
    folder = StorageFolder(str(run))
    data = collect_report_data(folder, read_run_record(folder), frozenset({2}), 6)
    payload = viewer_payload(data, None)
    assert [t["id"] for t in payload["trajectories"]] == ["0:0", "0:1", "1:0", "1:1", "2:0", "2:1"]
    assert [len(t["images"]) for t in payload["trajectories"]] == [1] * 6
    assert len(payload["images"]) == 3
    assert payload["trajectories"][0]["images"] == payload["trajectories"][1]["images"]
    assert all(url.startswith("data:image/jpeg;base64,") for url in payload["images"].values())
    assert sum(len(url) for url in payload["images"].values()) < IMAGE_BUDGET
    assert "at most 4 images per trajectory" in payload["image_limit"]
    first, *others = (len(url) for url in payload["images"].values())
    small = viewer.Thumbnails(budget=first + min(others) - 1)
    shown = [small.add(record.images) for record in data.sample]
    assert [entry["images_hidden"] for entry in shown] == [0, 0, 1, 1, 1, 1]
    # A sample of part of a part: a row whose image is stored with a row not sampled has it too.
    for size in range(1, 6):
        sample = collect_report_data(folder, read_run_record(folder), frozenset({2}), size).sample
        assert [len(record.images or []) for record in sample] == [1] * size
