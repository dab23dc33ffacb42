"""The input dataset at scale: files, directories, globs and s3:// URLs; preflight from metadata
plus a sample; each shard reads and filters only its own rows and gives verl's agent loops
exactly what verl's RLHFDataset gives for the same rows."""

from __future__ import annotations

import random
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from generation_core.config.loading import load_config
from generation_core.errors import BadInputRow, GenrunError, InputChanged
from generation_core.inputs.chat_rows import SAMPLE_ROWS
from generation_core.inputs.dataset_files import inspect_dataset
from generation_core.inputs.dataset_location import resolve_train_files
from generation_core.inputs.shard_rows import (
    OVERLONG_SAMPLE_ROWS,
    DatasetPrompts,
    read_rows,
    rows_digest,
)
from generation_core.run_plan import ShardSpec, plan_shards
from tests.conftest import chat_rows

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


def _rich_rows(count: int, first_index: int = 0) -> list[dict]:
    """Chat rows with every kind of field verl's agent loops read: tools_kwargs (some rows),
    a per-row agent_name (some null), an extra column, and some prompts too long for 64 tokens."""
    rows = []
    for i, row in enumerate(chat_rows(count, first_index)):
        index = first_index + i
        row["extra_info"]["tools_kwargs"] = {"calc": {"create_kwargs": {"seed": index}}} if index % 3 == 0 else None
        row["agent_name"] = "single_turn_agent" if index % 4 == 1 else None
        row["difficulty"] = float(index) / 10
        if index % 5 == 2:
            row["prompt"][0]["content"] = f"Describe item {index} in great detail. " * 30
        rows.append(row)
    return rows


def _write(path, rows, row_group_size):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def _cfg(files, *extra):
    # Quoted: Hydra's override grammar reads ~, * and [ as syntax.
    files = f"'{files}'" if isinstance(files, str) else "[" + ",".join(f"'{f}'" for f in files) + "]"
    return load_config([f"data.train_files={files}", "data.max_prompt_length=64", *extra])


def _verl_kwargs(dataset, position, default="single_turn_agent"):
    """What verl's generate_sequences hands an agent loop for a row of its dataset: the row's
    non-tensor fields, agent_name defaulted (also where a row's is null)."""
    row = dataset[position]
    kwargs = {k: v for k, v in row.items() if not isinstance(v, torch.Tensor)}
    if kwargs.get("agent_name") is None:
        kwargs["agent_name"] = default
    return kwargs


def _three_files(tmp_path):
    """20 rows in three files of 7, 5 and 8 rows, row groups of 3."""
    return [
        _write(tmp_path / "data" / "a.parquet", _rich_rows(7, 0), 3),
        _write(tmp_path / "data" / "b.parquet", _rich_rows(5, 7), 3),
        _write(tmp_path / "data" / "c.parquet", _rich_rows(8, 12), 3),
    ]


@pytest.mark.timeout(600)
def test_shard_rows_give_what_verls_dataset_gives(tmp_path, tokenizer):
    """Shards cut across file and row-group boundaries: their kept rows, in order, are verl's
    RLHFDataset's rows over the whole dataset (after its overlong filter), field for field,
    and the rows each shard filtered add up to what verl dropped."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    files = _three_files(tmp_path)
    cfg = _cfg(files)
    reference = RLHFDataset([str(f) for f in files], tokenizer, cfg.data, processor=None, max_samples=-1)
    dataset = inspect_dataset(cfg).files
    assert dataset.num_rows == 20
    # 3 shards: [0, 7) [7, 14) [14, 20); the second crosses from b.parquet into c.parquet, and
    # each starts or ends inside a row group.
    shards = plan_shards(dataset.num_rows, 3)
    assert [(s.start, s.end) for s in shards] == [(0, 7), (7, 14), (14, 20)]
    kept, filtered = [], 0
    for shard in shards:
        prompts = DatasetPrompts.for_shard(cfg, dataset, shard, tokenizer)
        assert prompts.agent_names() <= {"single_turn_agent"}
        assert prompts.filtered_overlong == 0, "nothing is tokenized before a row is asked about"
        for position in range(len(prompts)):
            kwargs = prompts.agent_kwargs(position)
            assert prompts.sample_index(position) == kwargs["index"] == kwargs["extra_info"]["index"]
            kept.append(kwargs)
        filtered += prompts.filtered_overlong
    assert filtered == 20 - len(reference) == 4, "rows 2, 7, 12, 17 are too long"
    assert kept == [_verl_kwargs(reference, p) for p in range(len(reference))]
    assert any(k["tools_kwargs"] for k in kept) and any(
        reference[p]["agent_name"] is None for p in range(len(reference))
    ), "the rows exercise both"

    # A range inside one row group of a.parquet into the middle of b.parquet.
    middle = DatasetPrompts(cfg, dataset, 5, 10, tokenizer)
    assert [middle.sample_index(p) for p in range(len(middle))] == [5, 6, 8, 9]
    assert middle.filtered_overlong == 1


@pytest.mark.parametrize("batched_agrees", [True, False])
def test_rows_past_the_first_window_are_decided_in_batches_as_verl_decides_them(
    tmp_path, tokenizer, monkeypatch, caplog, batched_agrees
):
    """Past the first DECIDE_WINDOW_ROWS (checked against verl's predicate row by row) a shard
    decides prompt lengths a window per tokenizer call; the kept rows are verl's either way, and
    a batched rule that disagrees with verl's is dropped for verl's own."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    import generation_core.inputs.shard_rows as data

    files = [_write(tmp_path / "data" / "a.parquet", _rich_rows(200), 50)]
    cfg = _cfg(files)
    if not batched_agrees:
        real = data._BatchedLengths.keeps
        monkeypatch.setattr(data._BatchedLengths, "keeps", lambda self, docs: [not k for k in real(self, docs)])
    reference = RLHFDataset([str(f) for f in files], tokenizer, cfg.data, processor=None, max_samples=-1)
    prompts = DatasetPrompts(cfg, inspect_dataset(cfg).files, 0, 200, tokenizer)
    with caplog.at_level("WARNING", logger="generation_core.inputs.shard_rows"):
        kept = [prompts.sample_index(p) for p in range(len(prompts))]
    assert kept == [reference[p]["extra_info"]["index"] for p in range(len(reference))]
    assert prompts.filtered_overlong == 40
    assert (prompts._batched_lengths is not None) == batched_agrees
    assert ("disagrees with verl's overlong filter" in caplog.text) != batched_agrees


def test_rows_of_a_range_are_read_from_the_overlapping_row_groups_only(tmp_path):
    files = _three_files(tmp_path)
    dataset = inspect_dataset(_cfg(files)).files
    table = read_rows(dataset, 5, 13, {})
    assert [row["index"] for row in table.column("extra_info").to_pylist()] == list(range(5, 13))
    # The same rows read from differently cut files give the same digest; one changed row does not.
    whole = pq.read_table(files[0]).slice(5, 2)
    again = pa.concat_tables([whole, pq.read_table(files[1]), pq.read_table(files[2]).slice(0, 1)])
    assert rows_digest(again) == rows_digest(table)
    changed = again.to_pylist()
    changed[3]["prompt"][0]["content"] = changed[3]["prompt"][0]["content"].replace("rain", "snow")
    assert rows_digest(pa.Table.from_pylist(changed, schema=again.schema)) != rows_digest(table)


def test_directories_globs_and_home_expand_in_sorted_order(tmp_path, monkeypatch):
    folder = tmp_path / "prompts"
    for name, first in (("part-2.parquet", 20), ("part-0.parquet", 0), ("part-1.parquet", 10)):
        _write(folder / name, chat_rows(3, first), 2)
    (folder / "notes.txt").write_text("not data")
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = [str(folder / f"part-{i}.parquet") for i in range(3)]
    assert resolve_train_files(_cfg(str(folder))) == expected, "a directory: every *.parquet, sorted"
    assert resolve_train_files(_cfg(str(folder / "part-*.parquet"))) == expected
    assert resolve_train_files(_cfg("~/prompts/part-1.parquet")) == expected[1:2]
    assert resolve_train_files(_cfg([folder / "part-2.parquet", f"{folder}/part-[01].parquet"])) == [
        expected[2],
        *expected[:2],
    ], "entries keep their order"
    inspection = inspect_dataset(_cfg(str(folder)))
    assert [f.rows for f in inspection.files.files] == [3, 3, 3] and inspection.files.num_rows == 9
    assert inspect_dataset(_cfg(str(folder), "data.train_max_samples=4")).files.num_rows == 4


def test_a_file_name_with_glob_characters_is_read_as_it_is(tmp_path):
    """Audit 2026-11-28 #5: `y[1].parquet` was read as the pattern that reads `y1.parquet`, and
    `star*.parquet` also read `star-other.parquet`. A name that exists as it is names that file;
    a pattern that names no file as it is still expands."""
    names = ["y[1].parquet", "y1.parquet", "star*.parquet", "star-other.parquet", "q?.parquet", "qa.parquet"]
    for position, name in enumerate(names):
        _write(tmp_path / name, chat_rows(2, 10 * position), 2)
    cfg = _cfg(str(tmp_path / names[0]))

    def resolved(name):
        cfg.data.train_files = str(tmp_path / name)
        return resolve_train_files(cfg)

    for name in ("y[1].parquet", "star*.parquet", "q?.parquet"):
        assert resolved(name) == [str(tmp_path / name)]
    assert resolved("y[0-9].parquet") == [str(tmp_path / "y1.parquet")]
    assert resolved("q*.parquet") == [str(tmp_path / n) for n in ("q?.parquet", "qa.parquet")]


def _null_content(rows, row):
    rows[row]["prompt"] = [{"role": "system", "content": None}, {"role": "user", "content": "hi there"}]
    return rows


@pytest.mark.parametrize(
    ("rows", "refusal"),
    [
        (_null_content(chat_rows(40), 30), "row 30 (extra_info.index 30): prompt[0].content is null"),
        (
            [dict(row, prompt=None) if row["extra_info"]["index"] == 2 else row for row in chat_rows(4)],
            "row 2 (extra_info.index 2): prompt is null",
        ),
        (
            [dict(row, prompt=[{"role": "user", "content": 7}]) for row in chat_rows(4)],
            "row 0 (extra_info.index 0): prompt[0].content is an int, not text or a list of text parts",
        ),
        (
            [dict(row, prompt=[]) if row["extra_info"]["index"] == 1 else row for row in chat_rows(4)],
            "row 1 (extra_info.index 1): prompt holds no messages",
        ),
        (
            [
                dict(row, prompt=[{"role": None, "content": "hi"}]) if row["extra_info"]["index"] == 3 else row
                for row in chat_rows(4)
            ],
            "row 3 (extra_info.index 3): prompt[0] is not a message with a role",
        ),
    ],
)
def test_preflight_refuses_sampled_rows_whose_messages_are_not_text_naming_file_row_and_index(tmp_path, rows, refusal):
    """Audit 2026-11-28 #1: a row with null (or int) content, or a null prompt, passed preflight,
    and verl's overlong filter, whose doc2len counts any chat-template error as too long, dropped
    it as "longer than max_prompt_length". The dataset's first rows are checked in preflight's light
    half (no tokenizer), refused in one line naming the file, the row and its extra_info.index."""
    path = _write(tmp_path / "bad.parquet", rows, 16)
    with pytest.raises(BadInputRow) as refused:
        inspect_dataset(_cfg(str(path)))
    assert str(refused.value) == f"data file {path} {refusal}; fix the row or leave it out of the dataset"


def test_a_shard_refuses_a_row_past_the_sample_and_a_template_error_is_never_counted_as_overlong(tmp_path, tokenizer):
    """Audit 2026-11-28 #1: every row a shard reads is checked (a null content past preflight's
    sample is refused by the shard, which is not retried: BadInputRow is an InputChanged), and a
    row whose chat template raises (text parts this model's template cannot join) is refused with
    the template's error, where verl's filter counted it as longer than max_prompt_length."""
    first = _write(tmp_path / "a.parquet", chat_rows(SAMPLE_ROWS), 64)
    second = _write(tmp_path / "b.parquet", _null_content(chat_rows(100, SAMPLE_ROWS), 90), 64)
    cfg = _cfg([first, second])
    dataset = inspect_dataset(cfg).files  # the bad row lies past the sample
    assert len(DatasetPrompts(cfg, dataset, 0, SAMPLE_ROWS, tokenizer)) == SAMPLE_ROWS
    with pytest.raises(BadInputRow) as refused:
        DatasetPrompts(cfg, dataset, 200, SAMPLE_ROWS + 100, tokenizer)
    assert isinstance(refused.value, InputChanged)
    assert str(refused.value) == (
        f"data file {second} row 90 (extra_info.index {SAMPLE_ROWS + 90}): prompt[0].content is null; "
        "fix the row or leave it out of the dataset"
    )

    parts = [dict(row, prompt=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]) for row in chat_rows(6)]
    path = _write(tmp_path / "parts.parquet", parts, 6)
    cfg = _cfg(str(path))
    prompts = DatasetPrompts(cfg, inspect_dataset(cfg).files, 0, 6, tokenizer)
    with pytest.raises(BadInputRow) as refused:
        prompts.keeps(0)
    assert str(refused.value) == (
        f"data file {path} row 0 (extra_info.index 0): the chat template cannot render its prompt (TypeError: can only "
        'concatenate str (not "list") to str); fix the row or leave it out of the dataset (verl would drop it as longer '
        "than data.max_prompt_length)"
    )
    assert prompts.filtered_overlong == 0


def test_the_fingerprint_reads_content_not_names_or_times(tmp_path):
    """A copy elsewhere is the same dataset; one prompt edited in the middle (same size) is not:
    the sampled hash covers a small file whole, and for a large one the shard's rows_digest does."""
    rows = chat_rows(40)
    original = _write(tmp_path / "a" / "prompts.parquet", rows, 8)
    copy = tmp_path / "b" / "renamed.parquet"
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    edited_rows = chat_rows(40)
    edited_rows[20]["prompt"][0]["content"] = edited_rows[20]["prompt"][0]["content"].replace("coffee", "toffee")
    edited = _write(tmp_path / "c" / "prompts.parquet", edited_rows, 8)
    assert edited_rows[20]["prompt"][0]["content"] != rows[20]["prompt"][0]["content"]
    assert original.stat().st_size == edited.stat().st_size
    digest = inspect_dataset(_cfg(str(original))).digest
    assert inspect_dataset(_cfg(str(copy))).digest == digest
    assert inspect_dataset(_cfg(str(edited))).digest != digest

    # A file far larger than the sampled slices: an edit between them may keep the fingerprint,
    # the rows digest of the shard holding the row changes.
    big = [dict(row, padding=random.Random(i).randbytes(1000).hex()) for i, row in enumerate(chat_rows(600))]
    big_original = _write(tmp_path / "d" / "big.parquet", big, 100)
    big[300]["prompt"][0]["content"] = big[300]["prompt"][0]["content"].replace("coffee", "toffee")
    big_edited = _write(tmp_path / "e" / "big.parquet", big, 100)
    assert big_original.stat().st_size > 64 * 4096
    dataset, changed = (inspect_dataset(_cfg(str(p))) for p in (big_original, big_edited))
    shard = plan_shards(600, 4)[2]
    assert shard.start <= 300 < shard.end
    digests = [rows_digest(read_rows(d.files, shard.start, shard.end, {})) for d in (dataset, changed)]
    assert digests[0] != digests[1]
    other = plan_shards(600, 4)[0]
    assert rows_digest(read_rows(dataset.files, other.start, other.end, {})) == rows_digest(
        read_rows(changed.files, other.start, other.end, {})
    )


def test_a_large_dataset_is_planned_without_tokenizing_it(tmp_path, model_dir, monkeypatch, fresh_tokenizer_cache):
    """50k rows: preflight reads footers and one column, and tokenizes a sample only."""
    from verl.utils import hf_tokenizer

    from generation_core.preflight import preflight as preflight_module

    rows = chat_rows(50_000)
    path = _write(tmp_path / "big.parquet", rows, 8192)
    # datasets runs verl's filter in a worker process (also for num_proc=1): count in a file.
    calls = tmp_path / "tokenizer_calls"

    def counting_tokenizer(*args, **kwargs):
        tokenizer = hf_tokenizer(*args, **kwargs)
        apply = tokenizer.apply_chat_template

        def counted(*a, **k):
            with open(calls, "a") as log:
                log.write("x")
            return apply(*a, **k)

        tokenizer.apply_chat_template = counted
        return tokenizer

    import verl.utils

    # preflight imports verl's loader when it needs it (after the light checks): patched at its source.
    monkeypatch.setattr(verl.utils, "hf_tokenizer", counting_tokenizer)
    plan = preflight_module.preflight(
        [f"data.train_files={path}", "generation.num_shards=16", f"trainer.default_local_dir={tmp_path / 'out'}"]
    )
    assert plan.dataset.num_rows == 50_000 and len(plan.shards) == 16
    assert 0 < len(calls.read_text()) <= OVERLONG_SAMPLE_ROWS
    assert len(str(plan.dataset.to_dict())) < 1000, "the plan carries file metadata, not rows"
    assert type(plan).from_json(plan.to_json()).dataset == plan.dataset


def test_only_a_sample_decides_that_every_prompt_is_too_long(tmp_path, model_dir):
    from generation_core.preflight.preflight import preflight

    rows = chat_rows(OVERLONG_SAMPLE_ROWS + 10)
    for row in rows[:OVERLONG_SAMPLE_ROWS]:
        row["prompt"][0]["content"] = "Describe the sea in great detail. " * 60
    path = _write(tmp_path / "long_first.parquet", rows, 64)
    with pytest.raises(
        GenrunError, match=rf"all {OVERLONG_SAMPLE_ROWS} sampled prompts .* longer than data.max_prompt_length=256"
    ):
        preflight([f"data.train_files={path}", f"trainer.default_local_dir={tmp_path / 'out'}"])


def test_large_json_is_refused_with_the_conversion(tmp_path, monkeypatch):
    import json

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in chat_rows(50)) + "\n")
    assert inspect_dataset(_cfg(str(path))).files.num_rows == 50, "small JSONL is read whole"
    monkeypatch.setattr("generation_core.inputs.dataset_files.JSON_MAX_BYTES", 1024)
    with pytest.raises(
        GenrunError,
        match=r"prompts.jsonl is 0 MiB of JSON, more than .*convert it to Parquet, e.g. python -c \"import pandas as pd; pd.read_json\(",
    ):
        inspect_dataset(_cfg(str(path)))


def _refused(argv, tmp_path, capsys, message):
    import re

    from flows.cli import main

    out = tmp_path / "out"
    code = main([*argv, f"trainer.default_local_dir={out}"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("genrun: error:")]
    assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), (argv, errors)
    assert not out.exists(), "a refused run writes nothing"


def test_bad_local_inputs_through_genrun(tmp_path, model_dir, capsys, monkeypatch):
    import json

    big_json = tmp_path / "big.jsonl"
    big_json.write_text("\n".join(json.dumps(row) for row in chat_rows(50)) + "\n")
    monkeypatch.setattr("generation_core.inputs.dataset_files.JSON_MAX_BYTES", 1024)
    _refused(
        [f"data.train_files={big_json}"],
        tmp_path,
        capsys,
        r"big.jsonl is 0 MiB of JSON, more than the 0 MiB .*convert it to Parquet",
    )
    first = _write(tmp_path / "one.parquet", chat_rows(3), 2)
    second = _write(tmp_path / "two.parquet", chat_rows(3, first_index=2), 2)
    _refused(
        [f"data.train_files=[{first},{second}]"],
        tmp_path,
        capsys,
        r"two.parquet row 0: extra_info.index 2 repeats \(also in .*one.parquet row 2\)",
    )


@pytest.fixture
def s3_input(s3_server, monkeypatch, tmp_path):
    """Two prompt files and a non-Parquet object on the local S3 server."""
    import s3fs

    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    fs = s3fs.S3FileSystem(endpoint_url=s3_server["AWS_ENDPOINT_URL"], use_listings_cache=False)
    local = _three_files(tmp_path)
    for path in local:
        fs.put_file(str(path), f"genrun-test/inputs/prompts/{path.name}")
    fs.pipe_file("genrun-test/inputs/broken.parquet", b"this is not parquet")
    return s3_server, local


@pytest.mark.slow
def test_s3_input_by_url_and_glob_reads_the_same_rows(s3_input, tmp_path, tokenizer, monkeypatch):
    s3_server, local = s3_input
    glob = "s3://genrun-test/inputs/prompts/*.parquet"
    cfg = _cfg(glob)
    assert resolve_train_files(cfg) == [f"s3://genrun-test/inputs/prompts/{p.name}" for p in local]
    remote = inspect_dataset(cfg)
    on_disk = inspect_dataset(_cfg(local))
    assert remote.digest == on_disk.digest, "the same bytes elsewhere are the same dataset"
    shard = ShardSpec(1, 5, 15)
    from_s3 = DatasetPrompts.for_shard(cfg, remote.files, shard, tokenizer)
    from_disk = DatasetPrompts.for_shard(_cfg(local), on_disk.files, shard, tokenizer)
    assert from_s3.rows_digest == from_disk.rows_digest
    assert [from_s3.agent_kwargs(p) for p in range(len(from_s3))] == [
        from_disk.agent_kwargs(p) for p in range(len(from_disk))
    ]

    # data.storage_options reaches the input where the environment does not: endpoint and keys.
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    options = [f"+data.storage_options.endpoint_url={s3_server['AWS_ENDPOINT_URL']}"]
    assert inspect_dataset(_cfg("s3://genrun-test/inputs/prompts", *options)).files == remote.files, "a directory URL"


@pytest.mark.slow
def test_bad_s3_inputs_get_one_line_and_write_nothing(s3_input, tmp_path, model_dir, capsys):
    for url, message in (
        (
            "s3://no-such-bucket-genrun/prompts.parquet",
            r"data file s3://no-such-bucket-genrun/prompts.parquet does not exist \(or its bucket does not\)",
        ),
        (
            "s3://genrun-test/inputs/missing.parquet",
            r"data file s3://genrun-test/inputs/missing.parquet does not exist",
        ),
        (
            "s3://genrun-test/inputs/nothing-*.parquet",
            r"pattern s3://genrun-test/inputs/nothing-\*.parquet matches no file",
        ),
        (
            "s3://no-such-bucket-genrun/*.parquet",
            r"(pattern s3://no-such-bucket-genrun/\*.parquet matches no file|does not exist)",
        ),
        (
            "s3://genrun-test/inputs/broken.parquet",
            r"data file s3://genrun-test/inputs/broken.parquet cannot be read as parquet",
        ),
    ):
        _refused([f"data.train_files={url}"], tmp_path, capsys, message)


def test_data_storage_options_are_operational_and_never_written(tmp_path):
    from omegaconf import OmegaConf

    from generation_core.preflight.fingerprint import fingerprint
    from generation_core.store.run_folder import config_without_secrets

    plain = _cfg(str(tmp_path / "x.parquet"))
    with_keys = _cfg(
        str(tmp_path / "x.parquet"),
        "data.storage_options.key=AKIA",
        "data.storage_options.secret=s3cr3t",
        "data.storage_options.endpoint_url=http://h:9",
    )
    assert fingerprint(plain, "d") == fingerprint(with_keys, "d"), "endpoint and credentials may change on resume"
    written = config_without_secrets(OmegaConf.to_container(with_keys, resolve=True))
    assert "s3cr3t" not in str(written) and "AKIA" not in str(written)
    assert written["data"]["storage_options"]["endpoint_url"] == "http://h:9"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_reads_its_prompts_from_s3_shard_by_shard(s3_input, ray_local, tmp_path):
    """The whole path with input on S3: shards read their rows there, filter them, and the
    summary adds up what each shard dropped."""
    import json

    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight

    plan = preflight(
        [
            "data.train_files='s3://genrun-test/inputs/prompts/*.parquet'",
            "data.max_prompt_length=64",
            f"trainer.default_local_dir={tmp_path / 'out'}",
            "actor_rollout_ref.rollout.name=instant",
            "generation.show_progress=false",
            "generation.num_shards=3",
        ]
    )
    summary = run_in_process(plan)
    assert summary["num_trajectories"] == 16 and summary["filtered_overlong_prompts"] == 4
    markers = [json.loads((tmp_path / "out" / "shards" / s.name / "_SUCCESS.json").read_text()) for s in plan.shards]
    assert [m["filtered_overlong"] for m in markers] == [1, 2, 1], "rows 2 | 7, 12 | 17: each shard counts its own"
    assert json.loads((tmp_path / "out" / "run.json").read_text())["dataset"]["num_rows"] == 20


def test_columns_json_has_no_type_for_reach_the_merged_output_as_text(tmp_path, model_dir, tokenizer):
    """A timestamp, a date, a decimal and a binary column (no JSON type) are carried as ISO text,
    the decimal's digits and base64: the shard commits (it used to fail at the part write,
    after generating every sample) and the merged DataProto holds the values."""
    import datetime
    import decimal

    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.outputs.merge import merge_run
    from generation_core.preflight.preflight import preflight
    from generation_core.shard.streaming import StreamingWorker
    from tests.shard_runs import run_shard

    table = pa.Table.from_pylist(chat_rows(2))
    table = table.append_column(
        "when", pa.array([datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.datetime(2025, 1, 1)], pa.timestamp("us"))
    )
    table = table.append_column("day", pa.array([datetime.date(2024, 1, 2), datetime.date(2024, 2, 3)], pa.date32()))
    table = table.append_column(
        "price", pa.array([decimal.Decimal("1.50"), decimal.Decimal("-2.25")], pa.decimal128(10, 2))
    )
    table = table.append_column("blob", pa.array([b"\x00\x01", b"hi"], pa.binary()))
    pq.write_table(table, tmp_path / "typed.parquet")
    plan = preflight(
        [
            f"data.train_files={tmp_path / 'typed.parquet'}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "actor_rollout_ref.rollout.name=instant",
            "data.max_prompt_length=64",
            "data.max_response_length=16",
            "generation.show_progress=false",
        ]
    )
    plan.claim_folder()
    [shard] = plan.shards
    prompts = DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer)
    worker = StreamingWorker(
        plan.cfg,
        InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id)),
    )
    try:
        manifest = run_shard(plan.cfg, shard, plan.folder, prompts, worker)
    finally:
        worker.shutdown()
    assert (manifest.num_trajectories, manifest.failures) == (2, 0)
    merged = merge_run(plan.folder, prompt_length=64, response_length=16, pad_token_id=tokenizer.pad_token_id)
    assert {key: merged.non_tensor_batch[key].tolist() for key in ("when", "day", "price", "blob")} == {
        "when": ["2024-01-02T03:04:05", "2025-01-01T00:00:00"],
        "day": ["2024-01-02", "2024-02-03"],
        "price": ["1.50", "-2.25"],
        "blob": ["AAE=", "aGk="],
    }


def test_a_file_changed_after_planning_is_refused_by_the_shard_that_reads_it(tmp_path):
    """A shard starts long after preflight: a file cut, replaced (same rows, other content) or
    with rows added meanwhile is refused with one line before the shard generates anything,
    instead of a shard that reads fewer (or other) rows and finishes as done."""
    import json

    files = _three_files(tmp_path)
    cfg = _cfg(str(tmp_path / "data"))
    dataset = inspect_dataset(cfg).files
    assert read_rows(dataset, 5, 15, {}).num_rows == 10
    # Cut: the last rows of b.parquet are gone.
    _write(files[1], _rich_rows(3, 7), 3)
    with pytest.raises(
        GenrunError, match=r"b\.parquet changed since the run was planned \(\d+ bytes, planned \d+\); restore the file"
    ):
        read_rows(dataset, 5, 15, {})
    # Other rows of the same count and, where possible, the same size: the footer tells.
    _write(files[1], [dict(row, difficulty=row["difficulty"] + 1) for row in _rich_rows(5, 7)], 3)
    with pytest.raises(GenrunError, match=r"b\.parquet changed since the run was planned"):
        read_rows(dataset, 5, 15, {})
    # Shards whose rows lie in unchanged files still read theirs.
    assert read_rows(dataset, 0, 7, {}).num_rows == 7
    # JSON: checked whole.
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rich_rows(4)))
    json_dataset = inspect_dataset(_cfg(str(path))).files
    path.write_text("".join(json.dumps(row) + "\n" for row in _rich_rows(3)))
    with pytest.raises(GenrunError, match=r"rows\.jsonl changed since the run was planned"):
        read_rows(json_dataset, 0, 4, {})


def test_the_merge_refuses_a_shard_that_does_not_account_for_its_rows():
    """committed + failed + filtered (x n) must be the shard's rows x n, else nothing is merged."""
    from generation_core.outputs.merge import check_shard_counts
    from generation_core.store.run_folder import SuccessMarker

    whole = SuccessMarker(
        "shard-00000", 0, [0, 10], num_trajectories=15, expected_trajectories=16, failures=1, filtered_overlong=2
    )
    check_shard_counts([whole], rollout_n=2)
    short = SuccessMarker("shard-00001", 1, [10, 20], num_trajectories=14, expected_trajectories=14)
    with pytest.raises(
        GenrunError,
        match=r"shard-00001 accounts for 14 of the 20 trajectories of its rows \[10, 20\) x n=2 .*input changed",
    ):
        check_shard_counts([whole, short], rollout_n=2)


def test_a_resume_does_not_reuse_a_finished_shard_whose_rows_were_edited_in_place(tmp_path, model_dir, tokenizer):
    """One ground truth changed in an uncompressed Parquet: same size, same footer (statistics
    included), so neither the sampled fingerprint nor the planned-file check can tell. The
    finished shard's rows are read again at resume and the digest its first attempt recorded
    refuses them, naming the shard and what to do; recheck_finished_rows=false gives that up."""

    from generation_core.engines.instant import InstantEngine, InstantSettings
    from generation_core.preflight.preflight import preflight
    from generation_core.run_plan import RunPlan
    from generation_core.shard.finished import finished_shards
    from generation_core.shard.streaming import StreamingWorker
    from tests.shard_runs import run_shard

    rows = chat_rows(6)
    for i, row in enumerate(rows):
        row["reward_model"] = {"style": "rule", "ground_truth": f"GT{i:02d}"}
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, compression="none")
    overrides = [
        f"data.train_files={path}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=instant",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
        "generation.show_progress=false",
        "generation.num_shards=2",
    ]
    plan = preflight(overrides)
    plan.claim_folder()
    engine = InstantEngine(InstantSettings(prompt_length=64, response_length=16, eos_token_id=tokenizer.eos_token_id))

    def run(shard):
        worker = StreamingWorker(plan.cfg, engine)
        try:
            return run_shard(
                plan.cfg,
                shard,
                plan.folder,
                DatasetPrompts.for_shard(plan.cfg, plan.dataset, shard, tokenizer),
                worker,
                dataset=plan.dataset,
            )
        finally:
            worker.shutdown()

    for shard in plan.shards:
        assert run(shard).num_trajectories == 3
    assert all(finished_shards(plan, plan.shards).values())  # unchanged rows: reused

    # GT04 -> GT03 in place: shard 1's rows (3..5) change; min and max (GT00, GT05) stay. The
    # rows digest covers the buffers a shard's rows are sliced from, here the file's one row
    # group: shard 0 reads as changed too (refused on the safe side).
    data = path.read_bytes()
    assert data.count(b"GT04") == 1
    path.write_bytes(data.replace(b"GT04", b"GT03"))
    assert inspect_dataset(plan.cfg).files == plan.dataset, "the planned size, footer and row counts cannot tell"
    assert read_rows(plan.dataset, 3, 6, {}).column("reward_model").to_pylist()[1]["ground_truth"] == "GT03"
    with pytest.raises(
        GenrunError,
        match=r"the dataset rows of finished shard-00000 \(and shard-00001\) changed since it was generated .*Restore the dataset as it was, or write to another trainer.default_local_dir",
    ):
        finished_shards(plan, plan.shards)
    with pytest.raises(GenrunError, match="the dataset rows of finished shard-00001 changed"):
        run(plan.shards[1])
    path.write_bytes(data)
    assert all(finished_shards(plan, plan.shards).values())  # restored: reused
    path.write_bytes(data.replace(b"GT04", b"GT03"))
    # The opt-out: the finished shard is reused as it is (a plan decides its settings once: a new plan).
    opted_out = plan.cfg.copy()
    opted_out.generation.recheck_finished_rows = False
    plan = RunPlan(opted_out, plan.fingerprint, plan.shards, plan.pad_token_id, plan.dataset, plan.model_digest)
    assert all(finished_shards(plan, plan.shards).values())
    assert run(plan.shards[1]).last_attempt.skipped
