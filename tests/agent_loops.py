"""Agent loops for tests, registered only through agent_loop_config_path YAML (agent_loops.yaml),
so they prove custom loops reach the Ray workers that run shards."""

import os

from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop


class FlakyAgentLoop(SingleTurnAgentLoop):
    """Raises for the sample whose index is GENRUN_TEST_FAIL_INDEX while the file
    GENRUN_TEST_FAIL_FLAG exists; with GENRUN_TEST_FAIL_MODE=once the first failure removes the
    file (fails once), otherwise it fails every attempt."""

    async def run(self, sampling_params, **kwargs):
        flag = os.environ.get("GENRUN_TEST_FAIL_FLAG")
        if flag and int(kwargs["index"]) == int(os.environ["GENRUN_TEST_FAIL_INDEX"]) and os.path.exists(flag):
            if os.environ.get("GENRUN_TEST_FAIL_MODE") == "once":
                os.remove(flag)
            raise RuntimeError(f"injected failure for index {kwargs['index']}")
        return await super().run(sampling_params, **kwargs)
