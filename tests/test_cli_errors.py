"""Bad input gets one clear line on stderr and exit code 2, before any model loads or any
output is written. The cases live in tests/bad_inputs.py (the chaos suite reuses them)."""

import pytest

from tests.bad_inputs import bad_input_cases, folder_contents, output_folder
from tests.conftest import run_genrun

pytestmark = pytest.mark.timeout(300)


def _refused_in_one_line(result_code, stderr, args, message):
    import re

    errors = [line for line in stderr.splitlines() if line.startswith("genrun: error:")]
    assert result_code == 2, (args, stderr[-2000:])
    assert len(errors) == 1 and re.search(message, errors[0]), (args, stderr[-2000:])
    assert "Traceback" not in stderr
    assert "Loading weights" not in stderr, "no model may load before the input is checked"


def test_bad_inputs_get_one_line_before_any_work(tmp_path, model_dir, capsys, monkeypatch):
    """Every bad input through the CLI's own entry function, in this process (a subprocess per
    input would spend most of the test importing torch and verl again)."""
    import ray

    from flows.cli import main

    # Another test of the session may have started Ray in this process already: what matters is
    # that a refused run never gets to start it (nor the Prefect server beside it).
    ray_was_up = ray.is_initialized()

    def start_ray_called(*_args, **_kwargs):
        raise AssertionError("a refused run reached start_ray")

    monkeypatch.setattr("generation_core.serving.ray_setup.start_ray", start_ray_called)
    for args, message in bad_input_cases(tmp_path):
        out = output_folder(args, tmp_path / "out")
        before = folder_contents(out)
        argv = args if out != tmp_path / "out" else [*args, f"trainer.default_local_dir={out}"]
        code = main(argv)
        _refused_in_one_line(code, capsys.readouterr().err, args, message)
        assert folder_contents(out) == before, f"a refused run writes nothing: {out} changed ({args})"
        assert ray.is_initialized() == ray_was_up, "refused before Ray (and any replica) started"


# CI time: the chaos schedule in make test runs sampled bad inputs through the real console script.
@pytest.mark.extended
def test_the_console_script_refuses_bad_input_in_one_line(tmp_path, model_dir):
    """The same contract seen by a user at the shell: the installed command, its exit code."""
    cases = [
        case
        for case in bad_input_cases(tmp_path)
        if any(word in case[1] for word in ("does not exist", "did you mean", "unknown agent loop 'tool_agnet'"))
    ]
    assert len(cases) >= 3
    for args, message in cases[:3]:
        out = tmp_path / "out"
        result = run_genrun([*args, f"trainer.default_local_dir={out}"], timeout=120)
        _refused_in_one_line(result.returncode, result.stderr, args, message)
        assert not out.exists(), "a refused run writes nothing"


@pytest.mark.parametrize("command", ["run", "status", "merge", "report", "export", "bench"])
def test_every_subcommand_answers_help(command, capsys):
    """`genrun export --help` (and every other subcommand's, the run's too: issue 44 item 6) prints
    its usage and its options and exits 0, before reading any folder or loading anything."""
    from flows.cli import main

    for flag in ("--help", "-h"):
        assert main([command, flag]) == 0
        out = capsys.readouterr().out
        assert out.startswith("usage:\n") and ("genrun [run] " if command == "run" else f"genrun {command} ") in out
        assert "-h, --help" in out and "genrun: error" not in out


def test_one_argparse_parser_per_subcommand_and_overrides_pass_through():
    """Issue 44 item 6: every subcommand `genrun --help` lists has its own argparse parser (no
    hand-written argv loop); a first word that names none starts a run, whose Hydra overrides
    (`key=value`, `+key=value`, `~key`) pass through unchanged, `run` written or not."""
    import re

    from flows.cli import USAGE, parse_command, subcommand_parsers

    listed = set(re.findall(r"^    genrun (\w+) ", USAGE, re.MULTILINE)) | {"run"}
    assert set(subcommand_parsers()) == listed == {"run", "status", "merge", "report", "export", "bench"}
    overrides = ["data.train_files=a.parquet", "+generation.extra=1", "~trainer.logger", "x='[1, -2]'"]
    for argv in (overrides, ["run", *overrides]):
        args = parse_command(argv)
        assert (args.command, args.overrides) == ("run", overrides)
    assert (parse_command([]).command, parse_command([]).overrides) == ("run", [])
    # The bench parses its own options: its arguments reach it unchanged.
    bench = ["--sittings", "2", "actor_rollout_ref.rollout.name=hf", "--keep"]
    assert vars(parse_command(["bench", *bench])) == {"command": "bench", "arguments": bench}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--frobnicate"], "unknown option '--frobnicate'; usage: genrun [run] [key=value ...]"),
        (["status"], "the following arguments are required: DIR; usage: genrun status DIR"),
        (["merge", "DIR", "--sample", "3"], "unknown option '--sample'; usage: genrun merge DIR"),
        (["export", "RUN"], "the following arguments are required: OUT; usage: genrun export RUN_DIR OUT"),
        (["export", "storage.options.anon=true", "RUN"], "give the run folder and the output file"),
    ],
)
def test_a_bad_command_line_is_one_line_and_exit_2(argv, message, capsys):
    """Issue 44 item 6: argparse's refusals come out as the CLI's one line (exit 2) naming the
    subcommand's usage, not argparse's usage block and exit."""
    from flows.cli import main

    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"genrun: error: {message}"), captured.err
    assert captured.err.count("\n") == 1
