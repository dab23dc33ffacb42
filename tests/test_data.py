import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from generation_core.config.loading import load_config
from generation_core.errors import GenrunError
from generation_core.inputs.dataset_files import inspect_dataset
from generation_core.run_plan import plan_shards
from tests.conftest import chat_rows, write_parquet

pytestmark = pytest.mark.timeout(300)


def _check(path, *extra):
    return inspect_dataset(load_config([f"data.train_files={path}", *extra])).digest


def test_valid_file_hashes_its_content(tmp_path):
    a = write_parquet(tmp_path / "a.parquet", chat_rows(4))
    b = write_parquet(tmp_path / "b.parquet", chat_rows(5))
    assert _check(a) == _check(a)
    assert _check(a) != _check(b)


def test_missing_file(tmp_path):
    with pytest.raises(GenrunError, match="does not exist"):
        _check(tmp_path / "nope.parquet")


def test_unsupported_format(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("a,b\n")
    with pytest.raises(GenrunError, match="unsupported format"):
        _check(path)


def test_not_parquet(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(GenrunError, match="cannot be read as parquet"):
        _check(path)


def test_missing_prompt_column(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"question": "hi", "extra_info": {"index": 0}}])
    with pytest.raises(GenrunError, match="no column 'prompt'.*data.prompt_key"):
        _check(path)


def test_prompt_not_chat_messages(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "plain text", "extra_info": {"index": 0}}])
    with pytest.raises(GenrunError, match="not a list of chat messages"):
        _check(path)


def test_empty_dataset(tmp_path):
    rows = chat_rows(1)
    table = pa.Table.from_pylist(rows).slice(0, 0)
    path = tmp_path / "empty.parquet"
    pq.write_table(table, path)
    with pytest.raises(GenrunError, match="empty"):
        _check(path)


def test_missing_index(tmp_path):
    rows = chat_rows(3)
    rows[1]["extra_info"] = {"split": "test", "index": None}
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(GenrunError, match="row 1: extra_info.index is missing"):
        _check(path)


def test_duplicate_index(tmp_path):
    rows = chat_rows(3)
    rows[2]["extra_info"]["index"] = 0
    path = write_parquet(tmp_path / "p.parquet", rows)
    with pytest.raises(GenrunError, match=r"p.parquet row 2: extra_info.index 0 repeats \(also in .*p.parquet row 0\)"):
        _check(path)


def test_shards_cover_every_row_once():
    shards = plan_shards(10, 3)
    assert [(s.start, s.end) for s in shards] == [(0, 4), (4, 7), (7, 10)]
    assert [s.name for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]
    with pytest.raises(GenrunError, match="num_shards=11 is more than the 10 prompts"):
        plan_shards(10, 11)


def test_overlong_prompts_dropped_are_counted_and_reported(tmp_path, model_dir, capsys):
    """Prompts verl's dataset drops as too long are never generated: each shard counts its own
    (in its manifest), the user sees the total in the run summary (manifest.json) and the CLI's
    output, not only in a log line."""
    import re

    from verl.utils import hf_tokenizer

    from flows.run_command import print_summary
    from generation_core.inputs.shard_rows import DatasetPrompts
    from generation_core.outputs.summary import summarize
    from generation_core.preflight.preflight import preflight
    from generation_core.store.run_folder import SuccessMarker

    rows = chat_rows(4)
    rows[1]["prompt"][0]["content"] = "Describe the sea in great detail. " * 60
    rows[3]["prompt"][0]["content"] = "Describe a cat in great detail. " * 60
    path = write_parquet(tmp_path / "mixed.parquet", rows)
    plan = preflight(
        [f"data.train_files={path}", "data.max_prompt_length=128", f"trainer.default_local_dir={tmp_path / 'out'}"]
    )
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, plan.shards[0], hf_tokenizer(str(model_dir)))
    assert (len(prompts), prompts.filtered_overlong) == (2, 2)
    assert [prompts.sample_index(i) for i in range(len(prompts))] == [0, 2]
    manifest = SuccessMarker(
        shard="shard-00000",
        shard_id=0,
        range=[0, 4],
        num_trajectories=2,
        expected_trajectories=2,
        filtered_overlong=prompts.filtered_overlong,
    )
    summary = summarize(plan, [SuccessMarker.from_dict(manifest.to_dict())], 0.0)
    assert summary["filtered_overlong_prompts"] == 2
    print_summary(summary, plan)
    assert re.search(r"skipped: +2 prompt\(s\) longer than data.max_prompt_length=128 tokens", capsys.readouterr().out)
