"""`genrun`: run generation (the same command resumes), show status, merge, inspect.

    genrun [run] [key=value ...]    run (or resume) generation with Hydra-style overrides
    genrun status DIR [storage.options.KEY=VALUE ...]
                                    shards done / running / pending with counts; on a
                                    running run its ETA and "stalled since ..." if it is
    genrun merge DIR [storage.options.KEY=VALUE ...]
                                    (re)build trajectories.pkl from committed parts
    genrun report DIR [--sample N] [--trust-remote-code] [storage.options.KEY=VALUE ...]
                                    write DIR/report.html: plots, shard table, failures,
                                    a trajectory viewer (N trajectories at most, default 500)
    genrun export DIR OUT.parquet [--min-reward X] [--best-of-n]
                  [--layout messages|prompt-completion|rl-prompts [--pass-rate MIN MAX] [--pass-threshold X]]
                  [--format parquet|openai-batch|openai-batch-input] [--overwrite]
                  [--tokenizer DIR] [--trust-remote-code] [storage.options.KEY=VALUE ...]
                                    committed trajectories as an SFT Parquet file (chat messages),
                                    sorted by (index, rollout_n); `genrun export --help` explains each option
    genrun bench [--sittings 3] [--prompts 64] [--tokens 32] [--json OUT] [--keep] [key=value ...]
                                    the engine's own offline benchmark and a genrun run on the
                                    same prompts and lengths, per sitting: tokens/s and genrun/engine

Reading a run folder runs no code from it: a tokenizer that is code in the run's model folder
runs only with --trust-remote-code (the run's own trust_remote_code setting is not followed).

Every subcommand is parsed by its own argparse parser (`genrun COMMAND --help` lists its options);
a first word that is no subcommand starts a run. Heavy imports (verl, torch, Prefect, Ray) wait
until the command needs them: `genrun --help` and a refused input answer at once.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from typing import Any, NoReturn, cast

from generation_core.benchmark.command import add_bench_arguments
from generation_core.config.bundled import cache_root
from generation_core.console import setup_logging
from generation_core.errors import GenrunError
from generation_core.exports.export_options import DESCRIPTION, SYNOPSIS, add_export_arguments, export_options_from
from generation_core.secrets import without_url_credentials

USAGE = __doc__

STORAGE_OPTIONS = "storage.options.KEY=VALUE"


class HelpRequested(Exception):
    """`-h`/`--help` after a subcommand: its help text, which `main` prints (exit 0, nothing read)."""


class _ShowHelp(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:
        raise HelpRequested(cast(CommandParser, parser).help_text())


class CommandParser(argparse.ArgumentParser):
    """One subcommand's parser: `--help` shows its synopsis and options, and a refusal is one
    GenrunError line (the CLI prints it, exit 2) instead of argparse's usage-and-exit."""

    def __init__(self, *, synopsis: str = "genrun [run] [key=value ...]", **kwargs: Any) -> None:
        super().__init__(add_help=False, allow_abbrev=False, usage=argparse.SUPPRESS, **kwargs)
        self.synopsis = synopsis
        self.add_argument(
            "-h", "--help", action=_ShowHelp, nargs=0, default=argparse.SUPPRESS, help="show this help and exit"
        )

    def help_text(self) -> str:
        return f"usage:\n    {self.synopsis}\n\n{self.format_help()}"

    def error(self, message: str) -> NoReturn:
        raise GenrunError(f"{message}; usage: {self.synopsis} ({self.prog} --help lists the options)")


def _positive_sample(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise GenrunError(f"--sample takes a positive number of trajectories (got {value!r})")
    return int(value)


def _folder_arguments(parser: CommandParser) -> CommandParser:
    parser.add_argument("folder", metavar="DIR", help="the run folder (local or s3://)")
    parser.add_argument(
        "storage",
        nargs="*",
        default=[],
        metavar=STORAGE_OPTIONS,
        help="fsspec options (e.g. storage.options.endpoint_url=URL)",
    )
    return parser


def subcommand_parsers() -> dict[str, CommandParser]:
    """One parser per subcommand (the run is one), each argument with the help text its `--help` shows."""
    commands = CommandParser(prog="genrun").add_subparsers(prog="genrun", parser_class=CommandParser)
    run = commands.add_parser(
        "run",
        description="Run (or resume: the same command skips what is committed) generation over the bundled "
        "config with Hydra-style overrides (docs/configuration.md). `run` may be left out.",
    )
    run.add_argument(
        "overrides", nargs="*", default=[], metavar="key=value", help="e.g. data.train_files=prompts.parquet"
    )
    _folder_arguments(
        commands.add_parser(
            "status",
            synopsis=f"genrun status DIR [{STORAGE_OPTIONS} ...]",
            description="Shards done / running / pending with counts; on a running run its ETA and "
            '"stalled since ..." if it is. Imports no torch, verl or Ray.',
        )
    )
    _folder_arguments(
        commands.add_parser(
            "merge",
            synopsis=f"genrun merge DIR [{STORAGE_OPTIONS} ...]",
            description="(Re)build trajectories.pkl and manifest.json from the committed parts.",
        )
    )
    report = _folder_arguments(
        commands.add_parser(
            "report",
            synopsis=f"genrun report DIR [--sample N] [--trust-remote-code] [{STORAGE_OPTIONS} ...]",
            description="Write DIR/report.html: plots, shard table, failures, a trajectory viewer.",
        )
    )
    report.add_argument(
        "--sample", type=_positive_sample, metavar="N", help="trajectories in the viewer at most (default 500)"
    )
    report.add_argument(
        "--trust-remote-code", action="store_true", help="run the code of a tokenizer the run folder names"
    )
    add_export_arguments(commands.add_parser("export", synopsis=SYNOPSIS, description=DESCRIPTION))
    bench = commands.add_parser(
        "bench",
        synopsis="genrun bench [--sittings 3] [--prompts 64] [--tokens 32] [--json OUT] [--keep] [key=value ...]",
        description="The engine's own offline benchmark and a genrun run on the same prompts and lengths, per "
        "sitting: tokens/s, genrun/engine and genrun's own CPU per trajectory outside the engine. A sitting whose "
        "engine side is slower than genrun's, or that ran at a load average above the cores, is marked NOT TRUSTED "
        "and left out of the answer (docs/engines.md).",
    )
    add_bench_arguments(bench)
    bench.add_argument("overrides", nargs="*", metavar="key=value", help="overrides as for a run (the engine too)")
    return commands.choices


def parse_command(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed by its subcommand's parser (`args.command` names it); a first word that names
    no subcommand is a run's first override."""
    parsers = subcommand_parsers()
    command = argv[0] if argv and argv[0] in parsers else "run"
    arguments = argv[1:] if argv and argv[0] == command else argv
    parser = parsers[command]
    if command == "bench":
        # The bench parses its own options (its module's entry point); here only --help is read.
        parser.parse_known_args(arguments)
        return argparse.Namespace(command=command, arguments=arguments)
    args, unknown = parser.parse_known_intermixed_args(arguments)
    if unknown:
        parser.error(f"unknown option {unknown[0]!r}")
    args.command = command
    return args


def _setup_environment() -> None:
    # verl's RLHFDataset writes through the HF datasets cache; keep it in our cache, not $HOME's default.
    os.environ.setdefault("HF_DATASETS_CACHE", str(cache_root() / "datasets"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # A few lines by default, everything at GENRUN_LOG_LEVEL=DEBUG (generation_core/console.py).
    setup_logging()


# s3fs reads these from the environment; credentials given as overrides move there, so they
# never reach Prefect flow-run parameters, logs or run.json.
CREDENTIAL_OVERRIDES = {
    "storage.options.key": "AWS_ACCESS_KEY_ID",
    "storage.options.secret": "AWS_SECRET_ACCESS_KEY",
    "storage.options.token": "AWS_SESSION_TOKEN",
}


# Input-bucket credentials have no environment variable of their own (s3fs reads one set), so
# they are refused as overrides rather than sent on in the flow run's parameters.
INPUT_CREDENTIAL_OVERRIDES = ("data.storage_options.key", "data.storage_options.secret", "data.storage_options.token")


def move_credentials_to_environment(argv: list[str]) -> list[str]:
    kept = []
    for override in argv:
        key, _, value = override.lstrip("+").partition("=")
        if key in INPUT_CREDENTIAL_OVERRIDES and value:
            raise GenrunError(
                f"{key} on the command line would be stored in the Prefect flow run's parameters; give the input "
                "bucket's credentials as a profile (data.storage_options.profile=NAME, from ~/.aws/credentials) or, "
                "when input and output share them, as storage.options.key/secret (data.storage_options null uses those)"
            )
        if key in CREDENTIAL_OVERRIDES and value:
            os.environ[CREDENTIAL_OVERRIDES[key]] = value
        else:
            kept.append(override)
    return kept


def storage_options_from(arguments: list[str]) -> dict[str, Any]:
    """`storage.options.KEY=VALUE` arguments of `genrun status` / `genrun merge` (credentials were
    moved to the environment already), as fsspec options."""
    options: dict[str, Any] = {}
    for argument in arguments:
        key, sep, value = argument.lstrip("+").partition("=")
        if not sep or not key.startswith("storage.options."):
            raise GenrunError(
                f"unexpected argument {argument!r}: after the folder only storage.options.KEY=VALUE may follow (e.g. storage.options.endpoint_url=http://127.0.0.1:9000)"
            )
        node = options
        *parents, leaf = key[len("storage.options.") :].split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return options


def _run(args: argparse.Namespace) -> int:
    from flows.run_command import generate_command

    return generate_command(args.overrides)


def _status(args: argparse.Namespace) -> int:
    from generation_core.outputs.status import print_status

    return print_status(args.folder, storage_options_from(args.storage))


def _merge(args: argparse.Namespace) -> int:
    # The merge writes verl's DataProto: torch, tensordict and verl load here, not for status.
    from generation_core.outputs.finish import merge_folder

    merge_folder(args.folder, storage_options_from(args.storage))
    return 0


def _report(args: argparse.Namespace) -> int:
    from generation_core.report.html import SAMPLE_SIZE, report_command

    options = storage_options_from(args.storage)
    return report_command(args.folder, options, args.sample or SAMPLE_SIZE, args.trust_remote_code)


def _export(args: argparse.Namespace) -> int:
    from generation_core.exports.export import export_command

    # Storage options may stand anywhere among the positional arguments: the other two are the paths.
    given = [args.run_dir, args.out, *args.storage]
    storage = [argument for argument in given if argument.lstrip("+").startswith("storage.")]
    paths = [argument for argument in given if argument not in storage]
    if len(paths) != 2:
        raise GenrunError(f"give the run folder and the output file; usage: {SYNOPSIS}")
    return export_command(paths[0], paths[1], export_options_from(args), storage_options_from(storage))


def _bench(args: argparse.Namespace) -> int:
    from generation_core.benchmark.command import bench_command

    return bench_command(args.arguments)


COMMANDS = {
    "run": _run,
    "status": _status,
    "merge": _merge,
    "report": _report,
    "export": _export,
    "bench": _bench,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    _setup_environment()
    try:
        args = parse_command(move_credentials_to_environment(argv))
        return COMMANDS[args.command](args)
    except HelpRequested as shown:
        print(shown)
        return 0
    except GenrunError as exc:
        # A message may quote a URL the user gave (a data file, a server): its credentials masked.
        print(f"genrun: error: {without_url_credentials(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("genrun: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except Exception as exc:
        import httpx

        from generation_core.driver.run_driver import ShardsFailed

        if isinstance(exc, ShardsFailed):
            # Which shards and why, in one line; the flow run's log has the tracebacks.
            print(f"genrun: error: {without_url_credentials(str(exc))}", file=sys.stderr)
            return 1
        if not isinstance(exc, httpx.TransportError):
            raise
        # The Prefect API stayed unreachable past its client's retries (about a minute; a
        # server down or restarting): one line instead of a traceback. Committed parts stay.
        url = without_url_credentials(os.environ.get("PREFECT_API_URL", ""))
        print(
            f"genrun: error: lost the Prefect API {url} ({type(exc).__name__}: {exc}); committed trajectories are kept, run the same command again to resume",
            file=sys.stderr,
        )
        return 1


def run() -> NoReturn:
    """The `genrun` command: `main`, then a quick exit."""
    try:
        code = main()
    except BrokenPipeError:
        # The reader of the output went away (`genrun status DIR | head -3`): no traceback, and
        # later writes go nowhere instead of raising again. Exit 1: the output was cut short
        # (Python's own advice for SIGPIPE).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit with `code` once every cleanup has run (threads that are not daemons joined, atexit
    handlers: logging's flush, Prefect's log and event workers, Ray's), skipping only the
    interpreter's teardown of its modules: with torch, transformers, verl and Ray loaded that
    took ~3 s of every run's end on 2 cores, after everything was written and stopped."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    _flush_output()
    atexit._run_exitfuncs()  # what the interpreter itself runs before its teardown
    _flush_output()
    os._exit(code)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away (`genrun status DIR | head`), a closed stream
            pass


if __name__ == "__main__":
    run()
