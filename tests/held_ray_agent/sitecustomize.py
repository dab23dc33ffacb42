"""Put on PYTHONPATH by tests/test_busy_start.py: the first Ray DashboardAgent started while
GENRUN_TEST_HOLD_RAY_AGENT_DIR is set waits GENRUN_TEST_HOLD_RAY_AGENT_SECONDS before it starts,
as the agents of a start on a loaded machine did (Ray's raylet gives the agent 15 s to report its
ports, then aborts, and the node's start fails). Python imports `sitecustomize` at every start;
this one does nothing in any other process, nor in an agent after the first (`held` exists)."""

import os
import sys
import time

_HOLD_DIR = os.environ.get("GENRUN_TEST_HOLD_RAY_AGENT_DIR")

if _HOLD_DIR and sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    try:
        os.close(os.open(os.path.join(_HOLD_DIR, "held"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass
    else:
        time.sleep(float(os.environ.get("GENRUN_TEST_HOLD_RAY_AGENT_SECONDS", "20")))
