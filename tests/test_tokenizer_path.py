"""One tokenizer loader (issue 44 item 14, review 2026-11-27 finding 10): every place genrun loads
the run's tokenizer follows `actor_rollout_ref.model.tokenizer_path` (else the model's path) and
the model's `custom_chat_template`, the rule verl's agent loops tokenize the prompts by. Before,
the preflight, the shard job and the run's last lines loaded the model path's tokenizer: a model
folder without tokenizer files was refused although tokenizer_path named one, and prompts were
filtered by a chat template the agent loops did not use."""

import shutil
from pathlib import Path

import pytest

from generation_core.inputs.tokenizer import run_tokenizer, tokenizer_dir
from tests.conftest import chat_rows, run_genrun, write_parquet

MARK = "Tokenizer path mark: this system turn comes from the tokenizer folder that tokenizer_path names."
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]


def _chat_ids(tokenizer, messages=MESSAGES) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def marked_tokenizer(model_dir, tmp_path_factory) -> Path:
    """The bundled model's tokenizer, copied, with a chat template that opens every chat with MARK."""
    folder = tmp_path_factory.mktemp("marked-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, folder / name)
    template = (model_dir / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text("<|im_start|>system\n" + MARK + "<|im_end|>\n" + template)
    return folder


@pytest.fixture(scope="module")
def model_without_tokenizer(model_dir, tmp_path_factory) -> Path:
    """The bundled model's config alone: what the instant engine and verl's model config read, and
    no tokenizer files (those come from tokenizer_path)."""
    folder = tmp_path_factory.mktemp("model-without-tokenizer")
    for name in ("config.json", "generation_config.json"):
        shutil.copy(model_dir / name, folder / name)
    return folder


@pytest.mark.timeout(120)
def test_the_run_tokenizer_is_tokenizer_path_else_the_model_path_with_the_custom_template(model_dir, marked_tokenizer):
    """Issue 44 item 14: one loader, verl's HFModelConfig rule (tokenizer_path, else path; then
    custom_chat_template)."""
    plain = run_tokenizer({"path": str(model_dir)})
    marked = run_tokenizer({"path": str(model_dir), "tokenizer_path": str(marked_tokenizer)})
    assert tokenizer_dir({"path": str(model_dir), "tokenizer_path": None}) == str(model_dir)
    assert tokenizer_dir({"path": str(model_dir), "tokenizer_path": str(marked_tokenizer)}) == str(marked_tokenizer)
    assert MARK not in plain.decode(_chat_ids(plain))
    assert marked.decode(_chat_ids(marked)).startswith(f"<|im_start|>system\n{MARK}<|im_end|>\n")
    custom = run_tokenizer(
        {"path": str(model_dir), "tokenizer_path": str(marked_tokenizer), "custom_chat_template": "{{ 'custom' }}"}
    )
    assert custom.decode(_chat_ids(custom)) == "custom"
    # verl's loader: its pad fallback (the bundled model pads with <|im_end|>, id 2).
    assert marked.pad_token_id == plain.pad_token_id == 2


@pytest.mark.timeout(300)
def test_a_run_tokenizes_filters_and_decodes_with_the_tokenizer_path(
    marked_tokenizer, model_without_tokenizer, tmp_path, prefect_server
):
    """Issue 44 item 14: a run whose model folder has no tokenizer files and whose tokenizer_path
    names one (with a chat template that adds a system turn) runs: its prompt ids are that
    template's, the overlong filter measures with it (the long prompt fits the model's own template,
    80 tokens, but not this one), and the run's example line decodes with it. Before, preflight
    refused the model folder for its missing tokenizer files."""
    from generation_core.store.folder import StorageFolder
    from tests.report_runs import committed_records

    long_row = dict(
        chat_rows(1, 3)[0],
        prompt=[
            {
                "role": "user",
                "content": "Write one short sentence about the sea, the sky, the wind, the rain, the sun and the "
                "moon, all of them together, in one breath (#3).",
            }
        ],
    )
    rows = chat_rows(3) + [long_row]
    prompts = write_parquet(tmp_path / "prompts.parquet", rows)
    out = tmp_path / "run"
    result = run_genrun(
        [
            f"data.train_files={prompts}",
            f"trainer.default_local_dir={out}",
            "actor_rollout_ref.rollout.name=instant",
            f"actor_rollout_ref.model.path={model_without_tokenizer}",
            f"actor_rollout_ref.model.tokenizer_path={marked_tokenizer}",
            "data.max_prompt_length=80",
            "data.max_response_length=16",
            "generation.show_progress=false",
        ],
        env=prefect_server.env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    tokenizer = run_tokenizer({"path": str(model_without_tokenizer), "tokenizer_path": str(marked_tokenizer)})
    records = committed_records(StorageFolder(str(out)))
    # The long row is filtered as overlong by the marked template (97 tokens > 80; 64 by the model's own).
    assert [record.index for record in records] == [0, 1, 2]
    for record, row in zip(records, rows, strict=False):
        assert list(record.prompt_ids) == _chat_ids(tokenizer, row["prompt"])
        assert tokenizer.decode(record.prompt_ids).startswith(f"<|im_start|>system\n{MARK}")
    assert f"prompt:   'system\\n{MARK}" in result.stdout
