"""Both SFT layouts of `genrun export` load into TRL's SFTTrainer as they are (issue 36, item 3):
the `messages` layout as TRL's conversational language-modeling dataset, `prompt-completion`
as its conversational prompt-completion dataset (loss on the completion only). A short run of
the instant engine is exported both ways; each file trains two steps of a tiny random Llama with
the bundled model's tokenizer and chat template (make test), and of the bundled model itself
(extended: about a minute on 2 cores)."""

from __future__ import annotations

import math

import pytest

from flows.cli import main
from tests.conftest import write_parquet

pytestmark = pytest.mark.timeout(300)

QUESTIONS = ["Say hi.", "What is 2 + 2?", "Name a color.", "Write one short sentence about the sea."]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, model_dir):
    """Two layers of width 16 over the bundled model's tokenizer (its vocabulary, chat template)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-chat")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(params=["tiny", pytest.param("bundled", marks=[pytest.mark.extended, pytest.mark.slow])])
def sft_model(request, tiny_chat_model, model_dir):
    return tiny_chat_model if request.param == "tiny" else model_dir


@pytest.fixture(scope="module")
def instant_run(tmp_path_factory, model_dir):
    """4 prompts, one sample each, of the instant engine, generated in this process (no Ray)."""

    from verl.utils import hf_tokenizer

    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.preflight.preflight import preflight
    from generation_core.shard.streaming import StreamingWorker
    from tests.shard_runs import run_shard

    base = tmp_path_factory.mktemp("trl")
    rows = [
        {
            "data_source": "test/chat",
            "prompt": [{"role": "user", "content": q}],
            "ability": "chat",
            "reward_model": {"style": "none", "ground_truth": ""},
            "extra_info": {"split": "test", "index": i},
        }
        for i, q in enumerate(QUESTIONS)
    ]
    plan = preflight(
        [
            f"data.train_files={write_parquet(base / 'prompts.parquet', rows)}",
            f"trainer.default_local_dir={base / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "generation.show_progress=false",
        ]
    )
    plan.claim_folder()
    tokenizer = hf_tokenizer(str(model_dir))
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))
    worker = StreamingWorker(plan.cfg, engine)
    try:
        assert run_shard(plan.cfg, shard, plan.folder, prompts, worker).num_trajectories == 4
    finally:
        worker.shutdown()
    return base / "run"


def _train(data_file, model_dir, tmp_path, columns):
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    dataset = datasets.load_dataset("parquet", data_files=str(data_file), split="train")
    assert set(columns) <= set(dataset.column_names)
    config = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-5,
        max_length=128,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        dataloader_num_workers=0,
        bf16=False,
        fp16=False,
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    trainer = SFTTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(str(model_dir))
    )
    batch = next(iter(trainer.get_train_dataloader()))
    result = trainer.train()
    return trainer, batch, result


def test_the_messages_layout_trains_in_trl(instant_run, sft_model, tmp_path):
    out = tmp_path / "messages.parquet"
    assert main(["export", str(instant_run), str(out)]) == 0
    trainer, batch, result = _train(out, sft_model, tmp_path, ["messages"])
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    # Language modeling over the whole conversation: every non-padding token is a target.
    assert (batch["labels"] != -100).sum() == batch["attention_mask"].sum()


def test_the_prompt_completion_layout_trains_on_the_completion_only(instant_run, sft_model, tmp_path):
    import pyarrow.parquet as pq

    out = tmp_path / "pc.parquet"
    assert main(["export", str(instant_run), str(out), "--layout", "prompt-completion"]) == 0
    assert pq.read_schema(out).names[:2] == ["prompt", "completion"]
    trainer, batch, result = _train(out, sft_model, tmp_path, ["prompt", "completion"])
    assert result.global_step == 2 and math.isfinite(result.training_loss)
    # TRL's completion-only loss: the prompt's tokens are not targets, the completion's are.
    targets = (batch["labels"] != -100).sum(dim=1)
    assert ((targets > 0) & (targets < batch["attention_mask"].sum(dim=1))).all()
