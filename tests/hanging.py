"""Code that never returns, for the sample-deadline tests (generation.sample_timeout_seconds):
it waits for RELEASE, which the test sets at its end so that no thread outlives it."""

import asyncio
import threading

from examples.tool_calling.calculator import CalculatorTool

RELEASE = threading.Event()


class CalculatorThatHangsInAThread(CalculatorTool):
    """The example calculator, except that for `3*4` it hands work to a thread (asyncio.to_thread)
    that never returns."""

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("expression") == "3*4":
            await asyncio.to_thread(RELEASE.wait)
        return await super().execute(instance_id, parameters, **kwargs)
