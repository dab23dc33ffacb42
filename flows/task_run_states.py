"""What the Prefect API shows for the shard task runs once their futures have ended.

A shard task on a Ray worker reports its states itself, as events its process sends in the
background; the API records them when they arrive. Two gaps follow, both visible in the UI a
person retries failed shards from:
- a task that ends right before the flow stops Ray (a cached shard takes milliseconds) can be
  killed with its last events unsent: its task run stays Pending or goes missing. The flow
  waits, briefly, until the API has every final state before Ray stops.
- a task whose worker died reports nothing more: its task run stays Running. The flow, which
  saw the crash, records it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from uuid import UUID

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
from prefect.exceptions import PrefectException
from prefect.states import State

logger = logging.getLogger(__name__)

# How often the API is asked while final states are still on their way.
POLL_SECONDS = 0.25


def record_crash(task_run_id: UUID, state: State) -> None:
    """Set the Crashed state the flow saw on a task run whose worker died (it cannot)."""
    try:
        with get_client(sync_client=True) as client:
            client.set_task_run_state(task_run_id, state, force=True)
    except (httpx.HTTPError, PrefectException) as exc:
        # What the UI shows; the flow's own outcome does not depend on it.
        logger.debug("could not record the crash of task run %s: %s", task_run_id, exc)


def wait_until_recorded(task_run_ids: Iterable[UUID], timeout: float) -> None:
    """Wait up to `timeout` seconds until the API shows every task run in a final state (while
    their Ray workers live on to send it); the ones it does not show so by then are logged."""
    waiting = set(task_run_ids)
    started = time.monotonic()
    polls = 0
    try:
        with get_client(sync_client=True) as client:
            while waiting:
                runs = client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=sorted(waiting))))
                waiting -= {run.id for run in runs if run.state is not None and run.state.is_final()}
                polls += 1
                if not waiting or time.monotonic() - started >= timeout:
                    break
                time.sleep(POLL_SECONDS)
    except (httpx.HTTPError, PrefectException) as exc:
        logger.debug("could not read the shard task runs' states: %s", exc)
    if waiting:
        logger.debug(
            "%d shard task run(s) not shown final by the Prefect API after %.1f s: %s",
            len(waiting),
            timeout,
            sorted(map(str, waiting)),
        )
    elif polls > 1:
        logger.debug(
            "the shard task runs' final states reached the Prefect API %.1f s after their futures ended",
            time.monotonic() - started,
        )
