"""`genrun export`'s options: the arguments the CLI's export subcommand takes (flows/cli.py builds the
parser; its `--help` lists every option), and the options they fill (`ExportOptions`), checked
together before any file is read.

Values are checked by the parser's type functions, which raise GenrunError with the one-line
message the CLI prints (argparse's own messages name no fix)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from generation_core.errors import GenrunError

RL_PROMPTS = "rl-prompts"
LAYOUTS = ("messages", "prompt-completion", RL_PROMPTS)
LAYOUT_ALIASES = {"prompt-response": "prompt-completion"}
"""The layout's earlier name, still accepted."""
OPENAI_BATCH = "openai-batch"
OPENAI_BATCH_INPUT = "openai-batch-input"
FORMATS = ("parquet", OPENAI_BATCH, OPENAI_BATCH_INPUT)
OUTPUT_SUFFIXES = {"parquet": ".parquet", OPENAI_BATCH: ".jsonl", OPENAI_BATCH_INPUT: ".jsonl"}
"""The name each --format's output file must end in: readers (pandas, datasets, verl) pick the
format by it, so `out.csv` holding Parquet would be read wrong (export_target refuses it)."""
SYNOPSIS = "genrun export RUN_DIR OUT [options] [storage.options.KEY=VALUE ...]"
DESCRIPTION = (
    "A run's committed trajectories as a file (local or s3://), sorted by (index, rollout_n), with a "
    "dataset card (README.md) beside a Parquet output. Nothing is written into the run folder, and an existing "
    "output is replaced only with --overwrite (docs/outputs.md)."
)


@dataclass
class ExportOptions:
    min_reward: float | None = None
    """Keep trajectories whose reward is at least this (unscored ones are dropped)."""
    best_of_n: bool = False
    """Keep the highest-scored trajectory of each prompt."""
    layout: str = "messages"
    format: str = "parquet"
    """`openai-batch`: the OpenAI Batch API's output layout (exports/openai_batch_output.py);
    `openai-batch-input`: its input layout, the run's prompts (exports/openai_batch_input.py)."""
    tokenizer: str | None = None
    """A tokenizer folder to use instead of the run's model path (when that is not on this machine)."""
    trust_remote_code: bool = False
    """Run the tokenizer's code from its folder (`--trust-remote-code`; run.json's setting is not followed)."""
    pass_rate: tuple[float, float] | None = None
    """rl-prompts: keep the prompts whose pass rate is in [MIN, MAX] (--pass-rate)."""
    pass_threshold: float | None = None
    """rl-prompts: a sample passes when its reward is above this (--pass-threshold; None: 0)."""
    overwrite: bool = False
    """Replace an existing output file (and the files written beside it under names derived from it)."""


def _number(option: str, what_nan_does: str):
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            raise GenrunError(f"{option} {value!r} is not a number") from None
        if math.isnan(number):
            raise GenrunError(f"{option} nan {what_nan_does}; give a number")
        return number

    return parse


def _layout(value: str) -> str:
    value = LAYOUT_ALIASES.get(value, value)
    if value not in LAYOUTS:
        raise GenrunError(f"--layout {value!r} is not one of {', '.join(LAYOUTS)}")
    return value


def _format(value: str) -> str:
    if value not in FORMATS:
        raise GenrunError(f"--format {value!r} is not one of {', '.join(FORMATS)}")
    return value


def _rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        raise GenrunError(
            f"--pass-rate {value!r}: give two numbers between 0 and 1, e.g. --pass-rate 0.1 0.9"
        ) from None
    if not 0 <= rate <= 1:
        raise GenrunError(f"--pass-rate {value}: needs 0 <= MIN <= MAX <= 1, e.g. --pass-rate 0.1 0.9")
    return rate


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Long: one add_argument per option, each with the help text `genrun export --help` shows."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder")
    parser.add_argument("out", metavar="OUT", help="the output file (local or s3://)")
    parser.add_argument(
        "storage",
        nargs="*",
        default=[],
        metavar="storage.options.KEY=VALUE",
        help="fsspec options for both (e.g. storage.options.endpoint_url=URL)",
    )
    parser.add_argument(
        "--layout",
        type=_layout,
        default="messages",
        metavar="|".join(LAYOUTS),
        help="Parquet columns: chat `messages` (default), TRL's `prompt`/`completion`, or one row per prompt "
        "in verl's RL layout with its pass rate (`rl-prompts`)",
    )
    parser.add_argument(
        "--format",
        type=_format,
        default="parquet",
        metavar="|".join(FORMATS),
        help="`parquet` (default); `openai-batch`: the OpenAI Batch API's output layout (JSONL, "
        "<stem>_errors.jsonl beside it); `openai-batch-input`: its input layout, the run's prompts and sampling",
    )
    parser.add_argument(
        "--min-reward",
        type=_number("--min-reward", "keeps nothing"),
        metavar="X",
        help="keep trajectories scored at least X",
    )
    parser.add_argument("--best-of-n", action="store_true", help="keep the highest-scored trajectory of each prompt")
    parser.add_argument(
        "--pass-rate",
        type=_rate,
        nargs=2,
        metavar=("MIN", "MAX"),
        help="rl-prompts: keep the prompts whose pass rate is in [MIN, MAX]",
    )
    parser.add_argument(
        "--pass-threshold",
        type=_number("--pass-threshold", "passes nothing"),
        metavar="X",
        help="rl-prompts: a sample passes when its reward is above X (default 0)",
    )
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="the tokenizer folder, when the run's model folder is not on this machine"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run a tokenizer's or tool's code named by the run folder (never run otherwise)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output file (and its error file); without it an existing one is refused",
    )


def export_options_from(parsed: argparse.Namespace) -> ExportOptions:
    """The options `add_export_arguments`' parser filled, checked together."""
    options = ExportOptions(
        min_reward=parsed.min_reward,
        best_of_n=parsed.best_of_n,
        layout=parsed.layout,
        format=parsed.format,
        tokenizer=parsed.tokenizer,
        trust_remote_code=parsed.trust_remote_code,
        pass_rate=tuple(parsed.pass_rate) if parsed.pass_rate else None,
        pass_threshold=parsed.pass_threshold,
        overwrite=parsed.overwrite,
    )
    check_combination(options)
    return options


def check_combination(options: ExportOptions) -> None:
    """Refuse options that do not go together (library callers get the same answers as the CLI)."""
    if options.pass_rate is not None and options.pass_rate[0] > options.pass_rate[1]:
        low, high = options.pass_rate
        raise GenrunError(f"--pass-rate {low:g} {high:g}: needs 0 <= MIN <= MAX <= 1, e.g. --pass-rate 0.1 0.9")
    if options.format != "parquet" and (
        options.min_reward is not None or options.best_of_n or options.layout != "messages"
    ):
        raise GenrunError(
            f"--format {options.format} writes every request of the run; "
            "it takes no --min-reward, --best-of-n or --layout"
        )
    if options.layout != RL_PROMPTS and (options.pass_rate is not None or options.pass_threshold is not None):
        raise GenrunError(f"--pass-rate and --pass-threshold go with --layout {RL_PROMPTS}; add it")
    if options.layout == RL_PROMPTS and (options.min_reward is not None or options.best_of_n):
        raise GenrunError(
            f"--min-reward and --best-of-n filter trajectories; "
            f"--layout {RL_PROMPTS} filters prompts with --pass-rate MIN MAX"
        )
