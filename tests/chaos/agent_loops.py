"""An agent loop that lets a chaos test hold a run in the middle of generation: samples whose
index is GENRUN_TEST_GATE_FROM or more (within its shard, see below) wait while the file
GENRUN_TEST_GATE exists, so the first part commits and the run then stays "generating" until
the test removes the file. Registered through agent_loops.yaml (agent_loop_config_path)."""

import asyncio
import os

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class GatedAgentLoop(SingleTurnAgentLoop):
    async def run(self, sampling_params, **kwargs):
        gate = os.environ.get("GENRUN_TEST_GATE")
        per_shard = int(os.environ.get("GENRUN_TEST_GATE_PER_SHARD", "1000000"))
        if gate and int(kwargs["index"]) % per_shard >= int(os.environ.get("GENRUN_TEST_GATE_FROM", "0")):
            while os.path.exists(gate):
                await asyncio.sleep(0.05)
        return await super().run(sampling_params, **kwargs)
