"""`genrun report RUN_DIR`: report.html from a real tool-calling run (plots, shard table,
failures, the viewer's trajectories with their masks and logprobs), the viewer's capped sample,
S3, refusals in one line, and the end of a run: the report written, its plots in W&B and in the
Prefect artifacts."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import numpy as np
import pytest
from PIL import Image

from flows.cli import main
from generation_core.report.data import sample_hash
from generation_core.report.html import REPORT_FILE
from generation_core.report.stop_reasons import STOP_REASONS, Limits, stop_reasons
from generation_core.store.folder import StorageFolder
from generation_core.store.trajectory_record import TrajectoryRecord, records_to_table
from tests.conftest import chat_rows, write_parquet
from tests.report_runs import COMMITTED, FAILING_ROW, ROLLOUT_N, ROWS, WRONG_ROW, committed_records, tool_run
from tests.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.timeout(300)

TOOL_TURN = "<|im_start|>tool\nRESULT<|im_end|>\n<|im_start|>assistant\n"
# The scripted engine is the shard's client itself (no routing): no replica ids, so no replica
# timeline; the time split is drawn in the Capacity section, after the others.
PLOTS = [
    "Response length",
    "Reward per data source",
    "Turns per trajectory",
    "Why responses stopped",
    "Throughput over time",
    "Where the time went",
]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_dir):
    directory = tmp_path_factory.mktemp("report-run")
    tool_run(directory, model_dir)
    return directory / "run"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from verl.utils import hf_tokenizer

    return hf_tokenizer(str(model_dir))


def viewer_data(page: str) -> dict:
    text = re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', page, re.S).group(1)
    return json.loads(text.replace("<\\/", "</"))


def report(run_dir, capsys, *arguments) -> tuple[int, str, str]:
    code = main(["report", str(run_dir), *arguments])
    out, err = capsys.readouterr()
    return code, out, err


def _record(response, mask, prompt=(1, 1)):
    return TrajectoryRecord(0, 0, list(prompt), list(response), list(mask), None, None, 2, {}, {}, {})


def test_stop_reasons_are_read_from_the_tokens_and_the_limits():
    limits = Limits(prompt_length=8, response_length=6, max_assistant_turns=2, eos_token_ids=frozenset({2}))
    cases = [
        (_record([5, 6, 2], [1, 1, 1]), "eos", 3),
        (_record([5, 6, 7, 8, 9, 2], [1] * 6), "eos", 6),  # EOS as the last token the budget allowed
        (_record([5, 6, 7, 8, 9, 10], [1] * 6), "length", 6),
        (_record([5, 6, 7], [1, 1, 1], prompt=[1] * 11), "length", 3),  # prompt + response filled the context
        (_record([5, 9, 9], [1, 0, 0]), "tool_turn", 1),
        (_record([5, 9, 6], [1, 0, 1]), "turn_limit", 2),
        (_record([5, 6], [1, 1]), "no_eos", 2),
        (_record([9, 2], [0, 1]), "eos", 1),
        (_record([], []), "no_eos", 0),
    ]
    codes, lengths, model_tokens = stop_reasons(records_to_table([record for record, _, _ in cases]), limits)
    assert [list(STOP_REASONS)[code] for code in codes] == [reason for _, reason, _ in cases]
    assert lengths.tolist() == [len(record.response_ids) for record, _, _ in cases]
    assert model_tokens.tolist() == [tokens for _, _, tokens in cases]


def test_sample_argument_is_read_and_checked():
    """Issue 44 item 6: `genrun report`'s arguments are read by its argparse parser (no hand-written
    argv loop): `--sample N` or `--sample=N` anywhere, the folder, then storage options."""
    from flows.cli import parse_command

    args = parse_command(["report", "DIR", "--sample", "7", "storage.options.anon=true"])
    assert (args.folder, args.sample, args.storage) == ("DIR", 7, ["storage.options.anon=true"])
    assert (parse_command(["report", "--sample=3", "DIR"]).sample, parse_command(["report", "DIR"]).sample) == (3, None)
    for bad, message in (
        (["--sample", "0"], "--sample takes a positive number of trajectories (got '0')"),
        (["--sample=x"], "--sample takes a positive number of trajectories (got 'x')"),
        (["--sample"], "argument --sample: expected one argument; usage: genrun report DIR"),
    ):
        with pytest.raises(Exception) as refused:
            parse_command(["report", "DIR", *bad])
        assert str(refused.value).startswith(message)


def test_viewer_data_holding_html_markup_stays_valid_json_inside_its_script_element():
    """Text with `<!--`, `</script>` and `&` (a model may write any of them) neither ends the
    viewer's <script> element nor breaks its JSON: the viewer would go blank."""
    from generation_core.report.html import _viewer_section

    nasty = "a <!-- comment --> then </script><script>alert(1)</script> & &amp; <\\!-- -->"
    payload = {
        "total": 1,
        "trajectories": [{"id": "0:0", "text": nasty}],
        "pieces": {"7": "</SCRIPT>"},
        "stop_reasons": {},
        "decoded": True,
    }
    section = _viewer_section(payload, 500)
    script = re.search(r'<script type="application/json" id="viewer-data">(.*?)</script>', section, re.S).group(1)
    assert json.loads(script) == payload
    assert "</script" not in script.lower() and "<!--" not in script and "&" not in script
    assert section.lower().count("</script>") == 2, "only the two elements' own end tags"


def test_report_of_a_tool_calling_run(run_dir, tokenizer, capsys):
    code, out, err = report(run_dir, capsys)
    assert code == 0, err
    assert out == f"report: {run_dir}/{REPORT_FILE} ({COMMITTED} trajectories; the viewer holds {COMMITTED})\n"
    page = (run_dir / REPORT_FILE).read_text()
    assert not re.search(r'(src|href)="(https?:|//)|@import|<link', page), "self-contained: nothing is fetched"

    # The genrun build that wrote it (run.json; every attempt record names the same one).
    from generation_core.build import describe_build, genrun_build

    assert f"<dt>genrun</dt><dd>{describe_build(genrun_build())}</dd>" in page and "attempts also by" not in page

    # Plots: every one drawn, each a real PNG.
    images = re.findall(r'<figure><img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', page)
    assert [alt for alt, _ in images] == PLOTS
    for _, data in images:
        assert Image.open(io.BytesIO(base64.b64decode(data))).size == (700, 360)

    # Shard table: 2 shards of 3 rows; the failing row is in the second.
    table = re.search(r'<table id="shard-table">.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)]
    assert [row[:6] for row in rows] == [
        ["shard-00000", "0–3", "done", "6", "6", "0"],
        ["shard-00001", "3–6", "done", "4", "6", "2"],
    ]

    # Failures: both samples of the failing row, with the engine's error.
    failures = re.search(r'<table id="failure-table">.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    # In the order the failure log has them (the order they failed in).
    assert sorted(re.findall(r"<td class=mono>(\d+:\d+)</td><td>([^<]+)</td>", failures)) == [
        (f"{FAILING_ROW}:{n}", "not generated") for n in range(ROLLOUT_N)
    ]
    assert (
        failures.count("<code>EngineCrashed: injected engine failure for a prompt with &#x27;carefully&#x27;</code>")
        == ROLLOUT_N
    )

    # The viewer: every committed trajectory, exactly as stored, turn by turn.
    data = viewer_data(page)
    records = committed_records(StorageFolder(str(run_dir)))
    assert data["total"] == COMMITTED and [t["id"] for t in data["trajectories"]] == [
        f"{r.index}:{r.rollout_n}" for r in records
    ]
    engine = ScriptedEngine(tokenizer)
    for shown, record in zip(data["trajectories"], records, strict=True):
        word, source = ROWS[record.index]
        assert shown["source"] == source and shown["turns"] == 4 and shown["stop"] == "eos"
        assert shown["reward"] == (0.0 if record.index == WRONG_ROW else 1.0)
        assert shown["ids"] == record.response_ids and shown["length"] == len(record.response_ids)
        mask = record.response_mask
        call, tool = mask.index(0), len(mask) - mask[::-1].index(0)
        assert shown["runs"] == [[1, call], [0, tool - call], [1, len(mask) - tool]]
        assert shown["logprobs"] == pytest.approx(
            engine.logprobs(call) + [0.0] * (tool - call) + engine.logprobs(len(mask) - tool), abs=1e-3
        )
        text = [shown["fix"].get(str(i), data["pieces"][str(token)]) for i, token in enumerate(shown["ids"])]
        answer = str(eval({"seven": "3+4", "twelve": "3*4", "nine": "(2+1)**2"}[word]))  # noqa: S307
        assert "".join(text[call:tool]) == TOOL_TURN.replace("RESULT", answer)
        assert "".join(text[tool:]) == f"The answer is {answer}.<|im_end|>"
        assert "".join(text) == tokenizer.decode(record.response_ids)
        assert shown["prompt"] == tokenizer.decode(record.prompt_ids)


def test_the_viewer_holds_a_capped_uniform_sample(run_dir, capsys, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    # --sample may come before the folder too.
    assert main(["report", "--sample", "3", str(copy)]) == 0
    out = capsys.readouterr().out
    assert out.endswith(f"({COMMITTED} trajectories; the viewer holds 3)\n")
    page = (copy / REPORT_FILE).read_text()
    data = viewer_data(page)
    records = committed_records(StorageFolder(str(copy)))
    hashes = sample_hash(np.array([r.index for r in records]), np.array([r.rollout_n for r in records]))
    lowest = sorted(records[i].key for i in np.argsort(hashes)[:3])
    assert [t["id"] for t in data["trajectories"]] == [f"{i}:{n}" for i, n in lowest]
    assert f"Showing 3 of {COMMITTED} trajectories: a uniform sample by sample id" in page
    # The figures above the viewer still cover every trajectory.
    assert f"<dt>trajectories</dt><dd>{COMMITTED}</dd>" in page


def test_report_of_an_unfinished_run(run_dir, capsys, tmp_path):
    """A run interrupted before its second shard committed anything: what is committed is shown."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "shards" / "shard-00001")
    code, out, err = report(copy, capsys)
    assert code == 0, err
    assert out.endswith("(6 trajectories; the viewer holds 6)\n")
    page = (copy / REPORT_FILE).read_text()
    table = re.search(r'<table id="shard-table">.*?<tbody>(.*?)</tbody>', page, re.S).group(1)
    rows = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)]
    assert [row[:7] for row in rows] == [
        ["shard-00000", "0–3", "done", "6", "6", "0", "3"],
        ["shard-00001", "3–6", "pending", "0", "6", "0", "0"],
    ]
    assert [t["id"] for t in viewer_data(page)["trajectories"]] == [
        f"{i}:{n}" for i in range(3) for n in range(ROLLOUT_N)
    ]
    assert "No sample failed." in page


def test_refusals_are_one_line_with_exit_2(run_dir, capsys, tmp_path):
    code, out, err = report(tmp_path / "nothing-here", capsys)
    assert (code, out) == (
        2,
        "",
    ) and err == f"genrun: error: {tmp_path / 'nothing-here'} is not a genrun run folder (no run.json)\n"
    # A run that has committed nothing yet: its run.json only.
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(run_dir / "run.json", empty / "run.json")
    code, out, err = report(empty, capsys)
    assert (code, out) == (2, "")
    assert (
        err
        == f"genrun: error: {empty} has no committed trajectories yet: nothing to report (`genrun status {empty}` shows its shards)\n"
    )
    assert not (empty / REPORT_FILE).exists()
    assert (
        main(["report"]) == 2
        and capsys.readouterr().err
        == "genrun: error: the following arguments are required: DIR; usage: genrun report DIR [--sample N] "
        "[--trust-remote-code] [storage.options.KEY=VALUE ...] (genrun report --help lists the options)\n"
    )
    assert main(["report", str(run_dir), "--sample", "-1"]) == 2
    assert capsys.readouterr().err == "genrun: error: --sample takes a positive number of trajectories (got '-1')\n"


def test_report_of_a_run_on_s3(run_dir, s3_server, monkeypatch, capsys):
    import fsspec

    endpoint = s3_server["AWS_ENDPOINT_URL"]
    options = {
        "endpoint_url": endpoint,
        "key": s3_server["AWS_ACCESS_KEY_ID"],
        "secret": s3_server["AWS_SECRET_ACCESS_KEY"],
    }
    url = "s3://genrun-test/runs/report"
    fs = fsspec.filesystem("s3", use_listings_cache=False, **options)
    fs.put(f"{run_dir}/", url, recursive=True)
    fs.rm(f"{url}/{REPORT_FILE}")
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    code, out, err = report(
        url,
        capsys,
        f"storage.options.endpoint_url={endpoint}",
        f"storage.options.key={options['key']}",
        f"storage.options.secret={options['secret']}",
    )
    assert code == 0, err
    assert out == f"report: {url}/{REPORT_FILE} ({COMMITTED} trajectories; the viewer holds {COMMITTED})\n"
    page = fs.cat_file(f"{url}/{REPORT_FILE}").decode()
    assert [t["id"] for t in viewer_data(page)["trajectories"]] == [
        f"{r.index}:{r.rollout_n}" for r in committed_records(StorageFolder(str(run_dir)))
    ]
    assert options["secret"] not in page + out


@pytest.mark.timeout(600)
def test_a_run_writes_its_report_and_logs_the_plots_to_wandb(ray_local, tmp_path, wandb_offline_dir):
    from generation_core.driver.in_process import run_in_process
    from generation_core.preflight.preflight import preflight
    from tests.wandb_offline import artifacts, history_keys, offline_run_files

    prompts = write_parquet(tmp_path / "prompts.parquet", chat_rows(5))
    out = tmp_path / "run"
    summary = run_in_process(
        preflight(
            [
                f"data.train_files={prompts}",
                f"trainer.default_local_dir={out}",
                "actor_rollout_ref.rollout.name=instant",
                "generation.show_progress=false",
                "trainer.logger=[console,wandb]",
            ]
        )
    )
    assert summary["published"]["report"] == f"{out}/{REPORT_FILE}"
    data = viewer_data((out / REPORT_FILE).read_text())
    assert data["total"] == 5 and [t["id"] for t in data["trajectories"]] == [f"{i}:0" for i in range(5)]
    assert all(t["logprobs"] is None and t["runs"] == [[1, t["length"]]] for t in data["trajectories"]), (
        "single-turn, no logprobs asked for"
    )
    (run_file,) = offline_run_files(wandb_offline_dir)
    # An image is logged as nested keys (report/<plot>/format, .../width, ...; the PNG is a media file).
    images = {
        key.rsplit("/", 1)[0] for key in history_keys(run_file) if key.startswith("report/") and key.endswith("/format")
    }
    assert images == {
        "report/response-length",
        "report/turns",
        "report/stop-reasons",
        "report/throughput",
        "report/replica-timeline",
        "report/time-split",
    }, "no reward in this run: no reward plot"
    assert artifacts(run_file) == [], "images in the run's history, no artifact beside the trajectories' own"


@pytest.mark.timeout(300)
def test_the_plots_become_prefect_artifacts(run_dir, prefect_server, tmp_path):
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from generation_core.report.html import write_report
    from tasks.publish import report_artifacts

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)

    @flow(name="report-artifacts")
    def show(location: str) -> str:
        from prefect.runtime import flow_run

        report_artifacts(write_report(StorageFolder(location)), "report-test")
        return flow_run.id

    with temporary_settings({PREFECT_API_URL: prefect_server.url}):
        flow_run_id = show(str(copy))
    artifacts = {
        a["key"]: a
        for a in prefect_server.api(
            "POST", "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
        )
    }
    names = ["response-length", "reward", "turns", "stop-reasons", "throughput", "time-split"]
    assert sorted(artifacts) == sorted([f"report-test-{name}" for name in names] + ["report-test-report"])
    for name in names:
        image = artifacts[f"report-test-{name}"]
        assert image["type"] == "image" and image["data"].startswith("data:image/png;base64,")
        Image.open(io.BytesIO(base64.b64decode(image["data"].partition(",")[2]))).verify()
    markdown = artifacts["report-test-report"]
    assert markdown["type"] == "markdown" and markdown["data"].count("](data:image/png;base64,") == len(names)
    assert f"`{copy}/{REPORT_FILE}`: {COMMITTED} trajectories" in markdown["data"]


def test_report_loads_no_verl_or_ray(run_dir, tmp_path):
    """`genrun report` is read-only: no verl, Ray or Prefect (issue 32, item 2), and no
    transformers or torch either (issue 45 item 6: seconds of a read-only command's start): the
    run's tokenizer.json is read with the `tokenizers` library."""
    from tests.test_light_imports import ENGINE_STACK, command_loads

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    assert sorted(command_loads(["report", str(copy)]) & {*ENGINE_STACK, "torch"}) == []
    # Made on another machine than the run's model: token ids in the viewer, no tokenizer loaded.
    run = json.loads((copy / "run.json").read_text())
    run["config"]["actor_rollout_ref"]["model"]["path"] = str(tmp_path / "model-elsewhere")
    (copy / "run.json").write_text(json.dumps(run))
    assert sorted(command_loads(["report", str(copy)]) & set(ENGINE_STACK)) == []


def test_the_viewers_decoder_decodes_as_transformers_does(model_dir):
    """The report's light decoder (report/token_decoder.py, no torch) gives transformers' text for
    every token of the bundled model alone and for random sequences, and the same eos id."""
    import random

    from transformers import AutoTokenizer

    from generation_core.report.token_decoder import TokenDecoder

    decoder, tokenizer = TokenDecoder.of_folder(model_dir), AutoTokenizer.from_pretrained(str(model_dir))
    assert decoder is not None and decoder.eos_token_id == tokenizer.eos_token_id
    every_token = [[token] for token in range(tokenizer.vocab_size)]
    assert decoder.batch_decode(every_token) == tokenizer.batch_decode(every_token)
    rng = random.Random(0)
    sequences = [[rng.randrange(tokenizer.vocab_size) for _ in range(40)] for _ in range(100)]
    assert [decoder.decode(ids) for ids in sequences] == [tokenizer.decode(ids) for ids in sequences]
