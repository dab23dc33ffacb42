"""What `genrun bench` says as a user meets it (issue 51 item 5): a line as each side of a sitting
starts and ends, a sitting whose figures cannot be trusted marked so and left out of the answer,
and `--help` describing every option. Both sides are stand-ins here: the real bench is
tests/test_bench.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from generation_core.benchmark import command
from generation_core.benchmark.command import Sitting, ratio_line, sitting_doubts
from generation_core.benchmark.genrun_side import GenrunRun

pytestmark = pytest.mark.timeout(60)


def _sitting(engine_rate: float, genrun_rate: float, doubts: list[str] | None = None) -> Sitting:
    return Sitting(int(engine_rate * 10), 10.0, int(genrun_rate * 10), 10.0, 60.0, 16, 500.0, doubts or [])


def test_bench_help_describes_every_option(capsys):
    from flows.cli import main

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    options = out.split("options:", 1)[1]
    for option, words in [
        ("--sittings N", "how many times both sides run"),
        ("--prompts N", "prompts taken from data.train_files (default 64)"),
        ("--tokens N", "tokens every response runs to"),
        ("--json OUT", "write the figures there"),
        ("--keep", "keep the scratch folder"),
    ]:
        assert option in options and words in " ".join(options.split()), (option, out)
    assert "NOT TRUSTED" in out and "key=value" in out


def test_a_sitting_disturbed_by_the_machine_is_not_trusted():
    """Row 61 of the newcomer report: an engine side of 0.7 tokens/s beside genrun's 18.2 on the
    same engine gave "genrun/engine 25.91" as if it were a figure."""
    broken = _sitting(0.7, 18.2)
    assert sitting_doubts(broken, load=1.0, cores=2) == [
        "the engine side (0.7 tokens/s) was slower than genrun's over the same engine (18.2): the machine's other "
        "work decided both"
    ]
    assert sitting_doubts(_sitting(20.0, 18.0), load=15.3, cores=2) == [
        "load average 15.3 above the 2 core(s) while it ran"
    ]
    assert sitting_doubts(_sitting(20.0, 18.0), load=1.5, cores=2) == []
    broken.doubts = sitting_doubts(broken, 1.0, 2)
    assert "\n    NOT TRUSTED: the engine side (0.7 tokens/s)" in broken.line(1)
    assert ratio_line([broken]) == (
        "genrun/engine: median 26.00 (min 26.00, max 26.00) over 1 sitting(s): NOT TRUSTED, no sitting's figures can "
        "be (see above); run it again on a quiet machine (a load average below its cores)"
    )
    fine = [_sitting(20.0, 18.0), _sitting(20.0, 16.0)]
    assert ratio_line([*fine, broken]) == (
        "genrun/engine: median 0.85 (min 0.80, max 0.90) over 2 sitting(s); 1 not trusted, left out"
    )


def test_each_side_says_when_it_starts_and_ends(monkeypatch, tmp_path, capsys):
    """At a load of 15 to 30 the bench was silent for 470 s: a line per side, as it runs."""
    said: list[str] = []
    loads = iter([1.0, 30.0, 1.0, 1.0, 1.0, 1.0])

    def engine(cfg, requests, tokens):
        said.append(capsys.readouterr().out)
        return 160, 10.0

    def genrun(overrides, prompts_file, tokens, folder):
        said.append(capsys.readouterr().out)
        return GenrunRun(150, 10.0, 60.0, 16, 400.0)

    work = command.Workload(
        SimpleNamespace(
            actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(n=2), model=SimpleNamespace(path="m"))
        ),
        "hf",
        tmp_path / "scratch",
        tmp_path / "scratch" / "prompts.parquet",
        [[1, 2]] * 16,
    )
    monkeypatch.setattr(command, "_workload", lambda args, overrides: work)
    monkeypatch.setitem(command.ENGINE_BENCHMARKS, "hf", engine)
    monkeypatch.setattr(command, "genrun_run", genrun)
    monkeypatch.setattr(command.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(command.os, "cpu_count", lambda: 2)
    assert command.bench_command(["--sittings", "2", "--prompts", "8", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert said[0].endswith("  sitting 1: the engine side (" + command.ENGINE_SIDE["hf"] + ") ...\n")
    assert (
        said[1]
        == "  sitting 1: the engine side gave 16.0 tokens/s (160 tokens in 10.0 s); now a whole genrun run ...\n"
    )
    assert said[2].startswith("  sitting 1: engine 16.0 tokens/s") and "NOT TRUSTED: load average 30.0" in said[2]
    assert "genrun/engine: median 0.94 (min 0.94, max 0.94) over 1 sitting(s); 1 not trusted, left out" in out
    figures = json.loads((tmp_path / "b.json").read_text())
    assert figures["trusted_ratio"] == {"median": 0.938, "min": 0.938, "max": 0.938}
    assert figures["sittings"][0]["doubts"] == ["load average 30.0 above the 2 core(s) while it ran"]
    assert not work.scratch.exists(), "--json given: the scratch folder goes"
