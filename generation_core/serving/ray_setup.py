"""How a run's processes join Ray: `ray.init` arguments from `ray_kwargs.ray_init`, with safe
single-host defaults (loopback only, no dashboard, a small object store, no token auth) and
quiet ones (Ray's INFO lines and its workers' stdout/stderr reach the terminal only at
GENRUN_LOG_LEVEL=DEBUG; the driver shows progress from the workers' counters instead).

A local Ray that misses its start-up deadlines is started once more. Ray 2.60 gives its
raylet's DashboardAgent 15 s to report its ports (the raylet aborts after that) and the node 30 s
to register (ray/_private/node.py); neither has a setting (RAY_raylet_start_wait_time_s and
RAY_agent_register_timeout_ms do not move them). On a loaded machine the agents' Python start
alone can take longer ("The current node timed out during startup"). The second start finds
their files in the page cache and the Prefect server started; a second failure is one line."""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import ray
from omegaconf import DictConfig, OmegaConf

from generation_core.config.layout import check_cluster_resources, resolve_layout
from generation_core.console import debug_output, machine_load
from generation_core.errors import GenrunError
from generation_core.processes import command_line, descendants, kill_and_wait, left_in_group, process_table
from generation_core.secrets import SECRETS_ENV

logger = logging.getLogger(__name__)

# What shard jobs on Ray workers need from the driver's environment (workers of a cluster that
# was started separately do not inherit it): the config's secrets among them, which the plan
# sent to a shard task (a Prefect parameter) holds masked.
RAY_WORKER_ENV = ("PREFECT_API_URL", "HF_DATASETS_CACHE", "PYTHONPATH", SECRETS_ENV)


def ray_init_kwargs(cfg: DictConfig, run_fingerprint: str, forward_env: tuple[str, ...] = ()) -> dict[str, Any]:
    """ray.init arguments from `ray_kwargs.ray_init`, with safe single-host defaults."""
    # Single-host runs need no token auth; a cluster passes its own settings via ray_init.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray's runtime env agent logs each runtime env it creates, env_vars and all, at INFO into
    # the session's logs: the Ray that genrun starts (its processes inherit this) logs warnings only.
    os.environ.setdefault("RAY_LOGGER_LEVEL", "warning")
    init_kwargs = {
        k: v for k, v in cast(dict[str, Any], OmegaConf.to_container(cfg.ray_kwargs.ray_init)).items() if v is not None
    }
    if "address" not in init_kwargs:
        init_kwargs.setdefault("_node_ip_address", "127.0.0.1")
        if init_kwargs["_node_ip_address"] == "127.0.0.1" and not os.environ.get("RAY_ADDRESS"):
            _keep_ray_on_loopback()
        init_kwargs.setdefault("include_dashboard", False)
        # The object store takes 30% of RAM unless capped; we only pass small markers through it.
        init_kwargs.setdefault("object_store_memory", 256 * 1024 * 1024)
    init_kwargs.setdefault("namespace", f"genrun-{run_fingerprint[:12]}")
    verbose = debug_output()
    init_kwargs.setdefault("log_to_driver", verbose)
    init_kwargs.setdefault("logging_level", logging.DEBUG if verbose else logging.WARNING)
    env_vars = {name: os.environ[name] for name in forward_env if name in os.environ}
    if env_vars:
        runtime_env = dict(init_kwargs.get("runtime_env") or {})
        runtime_env["env_vars"] = {**env_vars, **dict(runtime_env.get("env_vars") or {})}
        init_kwargs["runtime_env"] = runtime_env
    return init_kwargs


def ray_resources_before_start(cfg: DictConfig) -> dict[str, float] | None:
    """The Ray resources (CPU, GPU, ...) the run's replicas will be placed in, known before anything
    starts: this process's Ray when it has joined one already, else the local node the run would
    start, counted by Ray's own rule (`ray_kwargs.ray_init.num_cpus` / `num_gpus` / `resources`,
    else what Ray detects on this machine); None when the run joins a Ray started separately
    (`ray_init.address`, RAY_ADDRESS), whose nodes only a connection tells."""
    if ray.is_initialized():
        return cast(dict[str, float], ray.cluster_resources())
    init = {
        k: v for k, v in cast(dict[str, Any], OmegaConf.to_container(cfg.ray_kwargs.ray_init)).items() if v is not None
    }
    if init.get("address") not in (None, "local") or os.environ.get("RAY_ADDRESS"):
        return None
    from ray._private.resource_and_label_spec import ResourceAndLabelSpec

    try:
        spec = ResourceAndLabelSpec(
            num_cpus=init.get("num_cpus"), num_gpus=init.get("num_gpus"), resources=dict(init.get("resources") or {})
        )
        return cast(dict[str, float], spec.resolve(is_head=True, node_ip_address="127.0.0.1").to_resource_dict())
    except Exception as exc:  # noqa: BLE001 - ray.init says the same at the start, in its words
        logger.debug("could not count this machine's Ray resources: %s: %s", type(exc).__name__, exc)
        return None


def check_replicas_fit(cfg: DictConfig) -> None:
    """Refuse a layout the run's Ray cannot place, where that Ray is known before it is joined
    (`ray_resources_before_start`: the Ray already joined, or the one the run starts on
    this machine): before Prefect, Ray or a lease start and before run.json is written, so the
    corrected command finds the folder as it was."""
    layout = resolve_layout(cfg)
    if not layout.total_gpus:
        return  # CPU replicas (num_cpus=0) and remote servers fit any Ray
    resources = ray_resources_before_start(cfg)
    if resources is None:
        return  # a Ray started separately, not joined yet: ReplicaPool.boot checks its resources
    here = "this machine (ray_kwargs.ray_init.address is unset: the run starts Ray here)"
    check_cluster_resources(layout, resources, "the Ray cluster" if ray.is_initialized() else here)


def _keep_ray_on_loopback() -> None:
    """On Linux, Ray replaces _node_ip_address=127.0.0.1 with the host's routable IP and its
    GCS, raylet and workers listen on every interface. Its single-machine mode (the default on
    macOS/Windows) keeps every server on 127.0.0.1: the driver reads the flag from this module,
    the processes Ray starts read it from the environment they inherit."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(cfg: DictConfig, run_fingerprint: str, forward_env: tuple[str, ...] = ()) -> None:
    """Join (or start) the run's Ray, unless this process has already. A local start that fails
    is cleared away and tried once more; a second failure is a GenrunError saying what to do."""
    if ray.is_initialized():
        return
    init_kwargs = ray_init_kwargs(cfg, run_fingerprint, forward_env)
    if "address" in init_kwargs or os.environ.get("RAY_ADDRESS"):
        ray.init(**init_kwargs)  # a cluster started separately: its errors are about it, not this machine
        return
    for attempt in (1, 2):
        before = _local_ray_processes()
        try:
            ray.init(**init_kwargs)
            return
        except (TypeError, ValueError):
            raise  # ray_kwargs.ray_init that Ray refuses: another start would not change that
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when its node misses a deadline
            failure = _first_line(exc)
            ray.shutdown()
            # What the failed start left (its GCS, a raylet and its agents) would compete with the
            # next start for the CPU, and the agents outlive a crashed raylet by about a minute.
            left = {pid: started for pid, started in _local_ray_processes().items() if before.get(pid) != started}
            kill_and_wait(left)
            if attempt == 2:
                raise GenrunError(_did_not_start(failure)) from exc
            logger.warning("Ray's local node did not start (%s); starting it once more", failure)


def _local_ray_processes() -> dict[int, int]:
    """pid -> start time of the Ray processes this process started: those below it and those
    left in its process group when their parent died (a crashed raylet's agents)."""
    table = process_table()
    me = os.getpid()
    candidates = descendants(table, [me])
    if me in table:
        candidates |= left_in_group(table, table[me].pgid, 0)
    ray_root = os.path.dirname(ray.__file__).encode()
    return {
        pid: table[pid].started
        for pid in candidates
        if command_line(pid).startswith(b"ray::") or ray_root in command_line(pid)
    }


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _did_not_start(failure: str) -> str:
    load, cpus = machine_load()
    return (
        f"Ray's local node did not start, twice ({failure}) at a load of {load:.1f} on {cpus} CPU(s): "
        "Ray 2.60 gives its agents 15 s and its node 30 s to start, and has no setting for either; "
        "run the same command again when the machine is less busy, "
        "or start Ray separately and pass ray_kwargs.ray_init.address (docs/clusters.md)"
    )


def describe_ray() -> str:
    """Where this process's Ray runs, for the line that says what runs where."""
    if not ray.is_initialized():
        return "Ray not started"
    cpus = int(ray.cluster_resources().get("CPU", 0))
    nodes = len([node for node in ray.nodes() if node.get("Alive")])
    context = ray.get_runtime_context()
    started_here = ray._private.worker.global_worker.node is not None and ray._private.worker.global_worker.node.head
    if started_here:
        # Ray's own words for it (its INFO line is not shown by default).
        return f"Ray: Started a local Ray instance ({cpus} CPUs)"
    return f"Ray: joined the cluster at {context.gcs_address} ({nodes} node(s), {cpus} CPUs)"
