"""Running `genrun` the way a user does, for the benchmarks that time or measure whole runs."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig

REPO = Path(__file__).resolve().parent.parent
GENRUN = str(REPO / ".venv" / "bin" / "genrun")


def genrun_env(timeline: Path) -> dict[str, str]:
    """This environment with GENRUN_TIMELINE set and no Prefect API: each run starts its own
    temporary server, as `make demo` does."""
    env = dict(os.environ, GENRUN_TIMELINE=str(timeline))
    env.pop("PREFECT_API_URL", None)
    return env


def check_command(arguments: list[str]) -> DictConfig:
    """A bench's `--smoke` in place of a whole run (Prefect and Ray take a minute to start): genrun's
    own input checks (config keys, dataset, model folder) on the command the bench would run; its config."""
    from generation_core.preflight.preflight import check_inputs

    cfg = check_inputs(arguments).cfg
    print(f"smoke: genrun accepts {' '.join(arguments)}")
    return cfg


def write_prompts(path: Path, count: int, example: str = "single") -> None:
    """`count` one-line chat prompts ("Question number i?"), or the tool example's prompts repeated."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if example == "tool":
        source = pq.read_table(REPO / "examples" / "tool_calling" / "data" / "arithmetic.parquet").to_pylist()
        rows = [dict(source[i % len(source)]) for i in range(count)]
        for i, row in enumerate(rows):
            row["extra_info"] = {**(row.get("extra_info") or {}), "index": i}
    else:
        messages = [[{"role": "user", "content": f"Question number {i}?"}] for i in range(count)]
        rows = [
            {"data_source": "bench", "prompt": prompt, "extra_info": {"index": i}} for i, prompt in enumerate(messages)
        ]
    pq.write_table(pa.Table.from_pylist(rows), path)
