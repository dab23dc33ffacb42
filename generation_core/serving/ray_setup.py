"""How a run's processes join Ray: `ray.init` arguments from `ray_kwargs.ray_init`, with safe
single-host defaults (loopback only, no dashboard, a small object store, no token auth) and
quiet ones (Ray's INFO lines and its workers' stdout/stderr reach the terminal only at
GENRUN_LOG_LEVEL=DEBUG; the driver shows progress from the workers' counters instead)."""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import ray
from omegaconf import DictConfig, OmegaConf

from generation_core.console import debug_output
from generation_core.secrets import SECRETS_ENV

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
    init_kwargs = {k: v for k, v in cast(dict[str, Any], OmegaConf.to_container(cfg.ray_kwargs.ray_init)).items() if v is not None}
    if "address" not in init_kwargs:
        init_kwargs.setdefault("_node_ip_address", "127.0.0.1")
        if init_kwargs["_node_ip_address"] == "127.0.0.1" and not os.environ.get("RAY_ADDRESS"):
            _keep_ray_on_loopback()
        init_kwargs.setdefault("include_dashboard", False)
        # The object store takes 30% of RAM unless capped; we only pass small manifests through it.
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


def _keep_ray_on_loopback() -> None:
    """On Linux, Ray replaces _node_ip_address=127.0.0.1 with the host's routable IP and its
    GCS, raylet and workers listen on every interface. Its single-machine mode (the default on
    macOS/Windows) keeps every server on 127.0.0.1: the driver reads the flag from this module,
    the processes Ray starts read it from the environment they inherit."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def start_ray(cfg: DictConfig, run_fingerprint: str, forward_env: tuple[str, ...] = ()) -> None:
    """Join (or start) the run's Ray, unless this process has already."""
    if not ray.is_initialized():
        ray.init(**ray_init_kwargs(cfg, run_fingerprint, forward_env))


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
