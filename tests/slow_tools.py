"""A tool with latency, for the model-call slot tests (shard/call_slots.py): the example calculator
after an asyncio sleep, and how many of its calls run at once."""

import asyncio

from examples.tool_calling.calculator import CalculatorTool

TOOL_SECONDS = 0.05


class SlowCalculatorTool(CalculatorTool):
    """The example calculator, answering after TOOL_SECONDS (a sandbox, a web search...)."""

    running = 0
    peak_running = 0

    async def execute(self, instance_id, parameters, **kwargs):
        cls = type(self)
        cls.running += 1
        cls.peak_running = max(cls.peak_running, cls.running)
        try:
            await asyncio.sleep(TOOL_SECONDS)
        finally:
            cls.running -= 1
        return await super().execute(instance_id, parameters, **kwargs)
