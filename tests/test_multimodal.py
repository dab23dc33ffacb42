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

    from generation_core.inputs.tokenizer import run_processor
    from generation_core.inputs.vl_processor import VideoNeedsTorchvision

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


def _image_rows(count: int) -> list[dict]:
    """verl's layout: `<image>` in the prompt text, the `images` column of {"bytes": ...} cells."""
    return [
        {
            "data_source": "test/vl",
            "prompt": [{"role": "user", "content": f"<image>What is in picture {i}?"}],
            "images": [{"bytes": png_bytes(120 - 10 * i, 90, seed=i)}],
            "ability": "vision",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "test", "index": i},
        }
        for i in range(count)
    ]


def _instant_image_run(base, tiny_vl_dir, rows, n: int = 2, engine=None, overrides=(), scored=False):  # noqa: F811
    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.inputs.tokenizer import run_tokenizer
    from generation_core.preflight.preflight import preflight
    from generation_core.shard.rewards import RewardScorer
    from generation_core.shard.streaming import StreamingWorker
    from tests.conftest import write_parquet
    from tests.shard_runs import run_shard

    plan = preflight(
        [
            f"data.train_files={write_parquet(base / 'prompts.parquet', rows)}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={tiny_vl_dir}",
            "actor_rollout_ref.rollout.name=instant",
            f"actor_rollout_ref.rollout.n={n}",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "generation.show_progress=false",
            *overrides,
        ]
    )
    tokenizer = run_tokenizer(plan.cfg.actor_rollout_ref.model)
    plan.claim_folder()
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    worker = StreamingWorker(
        plan.cfg,
        engine
        or InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id)),
        RewardScorer.from_config(plan.cfg, tokenizer) if scored else None,
    )
    try:
        assert run_shard(plan.cfg, shard, plan.folder, prompts, worker).num_trajectories == len(rows) * n
    finally:
        worker.shutdown()
    return plan, tokenizer


def test_image_prompts_merge_as_verls_postprocess(tmp_path, tiny_vl_dir):  # noqa: F811
    """verl's layout through verl's agent loop on the instant engine: each merged row carries the
    multi_modal_inputs and the (4, seq) position_ids verl's own `_agent_loop_postprocess` makes
    from the same prompt, response and image; each image is stored once per prompt."""
    import asyncio
    from types import SimpleNamespace

    import torch
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, AgentLoopWorker

    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.inputs.images import fetch_image, open_png
    from generation_core.inputs.tokenizer import run_processor
    from generation_core.outputs.merge import merge_output
    from generation_core.outputs.padding import Padding
    from generation_core.store.part_repair import committed_parts, read_verified_part
    from generation_core.store.trajectory_record import read_part_table

    class RecordingEngine(InstantEngine):
        """The instant engine, noting the images each request carries (what verl's sglang and
        vllm servers get as `image_data`)."""

        sent: list = []

        async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
            self.sent.append(kwargs.get("image_data"))
            return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)

    rows = _image_rows(3)
    engine = RecordingEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=2))
    plan, tokenizer = _instant_image_run(tmp_path, tiny_vl_dir, rows, engine=engine)
    # Every request carries its prompt's one image, resized to the 28-pixel grid (120, 110 and 100 x 90 -> 112x84).
    assert [[image.size for image in images] for images in engine.sent] == [[(112, 84)]] * 6
    parts = [read_part_table(read_verified_part(plan.folder, p)) for p in committed_parts(plan.folder)]
    stored = [data for table in parts for cell in table.column("image_bytes").to_pylist() for data in cell or []]
    assert len(stored) == 3  # 3 prompts x n=2 samples, one image each: stored once per prompt
    merge_output(plan.folder, Padding(64, 16, tokenizer.pad_token_id))
    from verl.protocol import DataProto

    data = DataProto.load_from_disk(str(tmp_path / "run" / "trajectories.pkl"))
    assert len(data) == 6 and data.batch["position_ids"].shape == (6, 4, 80)
    processor = run_processor({"path": str(tiny_vl_dir)})
    verl_worker = SimpleNamespace(
        processor=processor,
        tokenizer=tokenizer,
        rollout_config=SimpleNamespace(prompt_length=64, response_length=16),
        _get_mm_processor_kwargs=lambda audios: {},
        reward_loop_worker_handles=None,
    )
    for name in ("_pad_token_ids", "_compute_multi_modal_inputs", "_compute_position_ids"):
        setattr(verl_worker, name, getattr(AgentLoopWorker, name).__get__(verl_worker))

    async def no_op(*_args, **_kwargs):
        return None

    verl_worker._compute_score = verl_worker._compute_teacher_logprobs = no_op
    for row in (0, 5):
        index = int(data.non_tensor_batch["index"][row]) if "index" in data.non_tensor_batch else row // 2
        image = fetch_image({"image": open_png(rows[index]["images"][0]["bytes"])}, 14)
        prompt = data.batch["prompts"][row][data.batch["attention_mask"][row][:64].bool()].tolist()
        response = data.batch["responses"][row][data.batch["attention_mask"][row][64:].bool()].tolist()
        output = AgentLoopOutput(
            prompt_ids=prompt,
            response_ids=response,
            response_mask=[1] * len(response),
            multi_modal_data={"images": [image]},
            num_turns=2,
            metrics={},
        )
        verls = asyncio.run(
            AgentLoopWorker._agent_loop_postprocess(verl_worker, output, False, raw_prompt=[])  # type: ignore[arg-type]
        )
        assert torch.equal(data.batch["position_ids"][row], verls.position_ids[0])
        ours = data.non_tensor_batch["multi_modal_inputs"][row]
        assert sorted(ours) == sorted(verls.multi_modal_inputs)
        for key, value in verls.multi_modal_inputs.items():
            assert torch.equal(ours[key], value), key
    assert data.non_tensor_batch["raw_prompt"][0][0]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "What is in picture 0?"},
    ]


def _refusal(tmp_path, model, rows, column_overrides=()) -> str:
    from generation_core.errors import GenrunError
    from generation_core.preflight.preflight import preflight
    from tests.conftest import write_parquet

    with pytest.raises(GenrunError) as refused:
        preflight(
            [
                f"data.train_files={write_parquet(tmp_path / 'prompts.parquet', rows)}",
                f"trainer.default_local_dir={tmp_path / 'run'}",
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.rollout.name=instant",
                "data.max_prompt_length=64",
                "data.max_response_length=16",
                *column_overrides,
            ]
        )
    assert not (tmp_path / "run").exists()
    message = str(refused.value)
    assert "\n" not in message
    return message


def test_bad_image_inputs_are_refused_in_one_line_before_anything_starts(tmp_path, tiny_vl_dir, model_dir):  # noqa: F811
    rows = _image_rows(2)
    assert "is a text-only llama model: images need a vision-language model" in _refusal(tmp_path, model_dir, rows)
    corrupt = _image_rows(2)
    corrupt[1]["images"] = [{"bytes": b"not an image"}]
    assert "row 1: 'images'[0] is not an image PIL can read" in _refusal(tmp_path, tiny_vl_dir, corrupt).replace(
        "images[0]", "'images'[0]"
    )
    missing = _image_rows(1)
    missing[0]["images"] = [{"path": str(tmp_path / "gone.png")}]
    assert f"names {str(tmp_path / 'gone.png')!r}, which does not exist" in _refusal(tmp_path, tiny_vl_dir, missing)
    extra = _image_rows(1)
    extra[0]["prompt"][0]["content"] = "<image><image>Compare them."
    assert "has 2 image placeholder(s)" in _refusal(tmp_path, tiny_vl_dir, extra)
    fewer = _image_rows(1)
    fewer[0]["images"] = fewer[0]["images"] * 2
    assert "has 1 image placeholder(s) (<image> in the text, or image parts) for 2 image(s)" in _refusal(
        tmp_path, tiny_vl_dir, fewer
    )
    video = _image_rows(1)
    video[0]["videos"] = [{"path": "clip.mp4"}]
    assert "holds videos, and genrun generates from images only" in _refusal(tmp_path, tiny_vl_dir, video)


def test_a_tiny_vl_model_generates_from_images_on_the_cpu(tmp_path, tiny_vl_dir):  # noqa: F811
    """The `hf` engine's VL path (engines/hf/vl.py): verl's agent loop sends the images, the model's
    forward takes their pixel_values and image_grid_thw, and the run merges with 4-row positions."""
    from verl.protocol import DataProto

    from generation_core.engines.hf.engine import EngineSettings, engine_on_this_node
    from generation_core.engines.hf.vl import VisionLanguageEngine
    from generation_core.outputs.merge import merge_output
    from generation_core.outputs.padding import Padding

    engine = engine_on_this_node(EngineSettings(str(tiny_vl_dir), prompt_length=64, response_length=16), 1)
    assert isinstance(engine, VisionLanguageEngine)
    plan, tokenizer = _instant_image_run(tmp_path, tiny_vl_dir, _image_rows(3), engine=engine)
    assert engine.stats["requests"] == 6
    merge_output(plan.folder, Padding(64, 16, tokenizer.pad_token_id))
    data = DataProto.load_from_disk(str(tmp_path / "run" / "trajectories.pkl"))
    assert data.batch["position_ids"].shape == (6, 4, 80)
    assert all(int(length) > 0 for length in data.batch["response_mask"].sum(dim=1))
    assert [tuple(inputs["image_grid_thw"].shape) for inputs in data.non_tensor_batch["multi_modal_inputs"]] == [
        (1, 3)
    ] * 6


def test_an_image_named_by_path_is_part_of_the_rows_digest(tmp_path):
    """A shard's rows digest (what a resume checks its rows against) covers the content of images
    named by path, as it covers bytes in the file: a changed image is a changed row, never reused."""
    import pyarrow as pa

    from generation_core.inputs.shard_rows import rows_digest

    image = tmp_path / "cat.png"
    image.write_bytes(png_bytes(64, 64, seed=1))
    table = pa.table({"images": [[{"path": str(image)}], None]})
    before = rows_digest(table)
    assert rows_digest(table) == before
    image.write_bytes(png_bytes(64, 64, seed=2))
    assert rows_digest(table) != before
    assert rows_digest(pa.table({"prompt": ["x"]})) == rows_digest(pa.table({"prompt": ["x"]}))


def test_the_verl_internals_the_image_path_relies_on_are_there():
    """verl_adapter's image functions name verl 0.9.1's private methods; an upgrade that renames
    or reshapes them fails here (the text path's pins are in tests/test_verl_adapter.py)."""
    import inspect

    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopWorker
    from verl.utils.dataset.rl_dataset import RLHFDataset

    assert list(inspect.signature(RLHFDataset._process_multi_modal_info).parameters) == [
        "messages",
        "image_patch_size",
        "config",
    ]
    assert "cls._process_multi_modal_info" in inspect.getsource(RLHFDataset.process_multi_modal_info)
    assert "self.dataset_cls.process_multi_modal_info" in inspect.getsource(AgentLoopBase.process_multi_modal_info)
    assert list(inspect.signature(AgentLoopWorker._compute_multi_modal_inputs).parameters) == [
        "self",
        "output",
        "input_ids",
    ]
    assert list(inspect.signature(AgentLoopWorker._compute_position_ids).parameters) == [
        "self",
        "input_ids",
        "attention_mask",
        "multi_modal_inputs",
        "mm_processor_kwargs",
    ]
    source = inspect.getsource(AgentLoopWorker._compute_multi_modal_inputs)
    assert "self.processor" in source and "self.tokenizer" in source and "self._get_mm_processor_kwargs" in source
    assert "self.processor = self.model_config.processor" in inspect.getsource(AgentLoopWorker.__init__)
