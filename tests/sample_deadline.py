"""For the sample-deadline tests (generation.sample_timeout_seconds): code that never returns (it
waits for RELEASE, which the test sets at its end so that no thread outlives it), and a shard's
failure log as records."""

import asyncio
import json
import threading
from pathlib import Path

from examples.tool_calling.calculator import CalculatorTool

RELEASE = threading.Event()


class CalculatorThatHangsInAThread(CalculatorTool):
    """The example calculator, except that for `3*4` it hands work to a thread (asyncio.to_thread)
    that never returns."""

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("expression") == "3*4":
            await asyncio.to_thread(RELEASE.wait)
        return await super().execute(instance_id, parameters, **kwargs)


def failure_log(shard_dir: Path) -> list[dict]:
    """The failure records of a local shard folder: its failures.jsonl, or, where the log is one
    file per commit record, failures/*.jsonl in commit order."""
    paths = [shard_dir / "failures.jsonl"] if (shard_dir / "failures.jsonl").exists() else []
    paths += sorted((shard_dir / "failures").glob("*.jsonl"))
    return [json.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
