"""Where a run's inference replicas go: count, GPUs and nodes per replica, Ray resources.

One place resolves the rollout config the way verl's LLMServerManager and RolloutReplica will,
so a wrong layout is refused in the preflight (seconds, no Ray, no model) instead of after a
placement group waited forever for GPUs that do not exist:

- `sglang` / `vllm` (verl's own replicas, on GPUs): replicas = n_gpus_per_node * nnodes /
  (tp * dp * pp); a replica spans ceil(world / n_gpus_per_node) nodes; verl places each in a
  placement group of GPU bundles (`[gpus_per_replica_node] * nodes_per_replica`).
- `hf` (transformers): no model parallelism; one replica per "GPU" slot, each holding one
  GPU when `engine_kwargs.hf.device` is cuda, none on the CPU.
- `instant` (the test/benchmark engine) and any engine registered from outside the product
  (engines/replicas.py `register_engine`, bench/sim): like `hf` on the CPU.
- `remote`: servers that already run elsewhere; one "replica" per base URL (`remote_urls`),
  nothing placed.

Shard tasks (agent loops, storage) never hold a GPU: `SHARD_TASK_RESOURCES`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from omegaconf import DictConfig

from generation_core.config.engine_kwargs import HfEngineKwargs, RemoteEngineKwargs, check_hf_device, hf_device
from generation_core.errors import GenrunError
from generation_core.secrets import without_url_credentials

GPU_ENGINES = ("sglang", "vllm")
"""verl's replicas, booted on the Ray cluster's GPUs."""

CPU_CAPABLE_ENGINES = {"hf", "instant"}
"""Engines served by one actor per replica, on the CPU; engines/replicas.py `register_engine` adds to it."""
REMOTE_ENGINE = "remote"

NOT_GENRUN_ENGINES = {
    "trtllm": "verl's TensorRT-LLM replica, which genrun does not run (it has no TensorRT-LLM engine)"
}
"""Rollout names verl knows that genrun does not run, with why (verl registers them all the same)."""

# A shard task runs agent loops, tokenization and storage I/O: one CPU, never a GPU, so that
# it can run on any node (a CPU-only head included) without taking a GPU from the replicas.
SHARD_TASK_RESOURCES = {"num_cpus": 1, "num_gpus": 0}

# verl's ResourcePoolManager(max_colocate_count=2) in RolloutReplica.init_standalone.
VERL_COLOCATE_COUNT = 2

# How each GPU engine gets installed: the module verl imports, and the fix to print.
ENGINE_PACKAGES = {
    "sglang": ("sglang", "install it with pip install 'genrun[sglang]' (docs/engines.md: GPU quick start)"),
    # verl 0.9.1's vllm 0.24.0 needs fastapi<0.137, prefect 3.8.8 needs >=0.139: no extra can hold both.
    "vllm": (
        "vllm",
        "verl 0.9.1's vLLM (0.24.0) cannot be installed beside Prefect 3.8.8 (fastapi <0.137 vs >=0.139); "
        "serve vLLM in an environment of its own and use rollout.name=remote (docs/engines.md: External inference servers)",
    ),
}


@dataclass(frozen=True)
class ReplicaLayout:
    engine: str
    replicas: int
    gpus_per_replica: int
    """GPUs one replica holds (tp * dp * pp for sglang/vllm; 1 or 0 for hf)."""
    nodes_per_replica: int
    gpus_per_replica_node: int
    """GPUs of one node a replica takes: a placement group bundle's size."""
    tensor_parallel: int
    data_parallel: int
    pipeline_parallel: int
    gpu_memory_utilization: float | None
    remote_urls: tuple[str, ...] = ()

    @property
    def total_gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    @property
    def placement_groups(self) -> list[list[dict[str, float]]]:
        """One replica's Ray placement groups as verl's RayResourcePool asks for them: one group
        per node the replica spans, one bundle per GPU process ({"CPU": 2, "GPU": 1}; verl
        colocates up to 2 processes per bundle). Empty for engines verl does not place."""
        if self.engine not in GPU_ENGINES:
            return []
        return [
            [{"CPU": VERL_COLOCATE_COUNT, "GPU": 1} for _ in range(self.gpus_per_replica_node)]
            for _ in range(self.nodes_per_replica)
        ]

    def describe(self) -> str:
        if self.engine == REMOTE_ENGINE:
            return f"{self.replicas} remote server(s): {', '.join(self.remote_urls)}"
        if not self.gpus_per_replica:
            return f"{self.replicas} {self.engine} replica(s) on the CPU"
        return (
            f"{self.replicas} {self.engine} replica(s) x {self.gpus_per_replica} GPU(s) "
            f"(tp={self.tensor_parallel} dp={self.data_parallel} pp={self.pipeline_parallel}, "
            f"{self.nodes_per_replica} node(s) each){self._memory()}"
        )

    def _memory(self) -> str:
        return "" if self.gpu_memory_utilization is None else f", gpu_memory_utilization={self.gpu_memory_utilization}"


def engine_names() -> list[str]:
    """Every `actor_rollout_ref.rollout.name` genrun runs, the one list of them: verl's GPU replicas,
    genrun's own engines with those registered in this process (`register_engine`), and remote.
    Light: a wrong name is refused before the engine stack imports."""
    return sorted({*GPU_ENGINES, *CPU_CAPABLE_ENGINES, REMOTE_ENGINE})


def check_engine_name(name: Any) -> None:
    """Refuse a rollout name genrun does not run (one line, the known names), before anything starts."""
    if name in engine_names():
        return
    why = f" is {NOT_GENRUN_ENGINES[name]}" if isinstance(name, str) and name in NOT_GENRUN_ENGINES else ""
    raise GenrunError(
        f"{'' if why else 'unknown '}actor_rollout_ref.rollout.name={name!r}{why}; known engines: {', '.join(engine_names())}"
    )


def resolve_layout(cfg: DictConfig) -> ReplicaLayout:
    """The replica layout `cfg` asks for, or a GenrunError naming the key to change."""
    rollout = cfg.actor_rollout_ref.rollout
    engine = rollout.name
    check_engine_name(engine)
    # Integers >= 1: config.validate_values checked them.
    gpus_per_node, nnodes = cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes
    tp, dp, pp = rollout.tensor_model_parallel_size, rollout.data_parallel_size, rollout.pipeline_model_parallel_size
    world = tp * dp * pp
    slots = gpus_per_node * nnodes

    if engine == REMOTE_ENGINE:
        urls = remote_urls(cfg)
        return ReplicaLayout(engine, len(urls), 0, 0, 0, 1, 1, 1, None, tuple(urls))

    if engine in CPU_CAPABLE_ENGINES:
        if world != 1:
            raise GenrunError(
                f"rollout.name={engine} has no model parallelism (tensor/data/pipeline parallel sizes "
                f"{tp}/{dp}/{pp}); set actor_rollout_ref.rollout.tensor_model_parallel_size=1 (and data/pipeline 1), "
                "or use rollout.name=sglang / vllm on GPUs"
            )
        on_gpu = engine == "hf" and checked_hf_device(cfg).startswith("cuda")
        return ReplicaLayout(engine, slots, int(on_gpu), int(on_gpu), int(on_gpu), 1, 1, 1, None)

    _check_with_verl(rollout)
    if rollout.get("load_format") == "dummy":
        raise GenrunError(
            f"actor_rollout_ref.rollout.load_format=dummy: {engine} would generate from random weights (verl's training "
            "default: there a trainer pushes the real weights after boot, and genrun has none); use auto (the default) "
            "to load model.path. For a throughput benchmark without real weights, save a randomly initialised model "
            "(bench/gpu/build_model.py) and point model.path at it"
        )
    memory = rollout.gpu_memory_utilization
    if not isinstance(memory, int | float) or isinstance(memory, bool) or not 0 < memory <= 1:
        raise GenrunError(
            f"invalid actor_rollout_ref.rollout.gpu_memory_utilization={memory!r}: the fraction of each GPU's memory "
            "the engine may take, in (0, 1] (0.85 is usual)"
        )
    if world > slots or slots % world:
        raise GenrunError(
            f"rollout.name={engine}: {slots} GPU(s) (trainer.n_gpus_per_node={gpus_per_node} x trainer.nnodes={nnodes}) "
            f"cannot be split into replicas of tensor x data x pipeline parallel = {tp} x {dp} x {pp} = {world} GPUs; "
            f"choose sizes whose product divides {slots}, or set the GPU counts to a multiple of {world}"
        )
    per_node = min(gpus_per_node, world)
    if world % per_node:
        raise GenrunError(
            f"rollout.name={engine}: a replica of {world} GPUs cannot span nodes of {gpus_per_node} GPUs evenly; "
            f"make tensor x data x pipeline parallel ({world}) a multiple of trainer.n_gpus_per_node or at most it"
        )
    return ReplicaLayout(engine, slots // world, world, world // per_node, per_node, tp, dp, pp, float(memory))


def remote_settings(cfg: DictConfig) -> RemoteEngineKwargs:
    """`actor_rollout_ref.rollout.engine_kwargs.remote`: base_urls, model, api_key, timeouts."""
    return RemoteEngineKwargs.of(cfg.actor_rollout_ref.rollout.engine_kwargs)


def remote_urls(cfg: DictConfig) -> list[str]:
    """The configured base URLs, normalized (no trailing / or /v1), or a GenrunError."""
    key = "actor_rollout_ref.rollout.engine_kwargs.remote.base_urls"
    urls: Any = remote_settings(cfg).base_urls
    if isinstance(urls, str):
        urls = [part for part in urls.split(",") if part.strip()]
    if not urls:
        raise GenrunError(
            f"rollout.name=remote needs the servers' base URLs: set {key}='[http://host1:8000,http://host2:8000]' "
            "(OpenAI-compatible servers such as vllm serve or sglang.launch_server, already running)"
        )
    normalized = []
    for url in urls:
        parts = urlsplit(str(url).strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise GenrunError(
                f"invalid URL {without_url_credentials(str(url))!r} in {key}: write http://host:port (the server's base URL)"
            )
        path = parts.path.rstrip("/")
        if path.endswith("/v1"):
            path = path[: -len("/v1")]
        base = f"{parts.scheme}://{parts.netloc}{path}"
        if base in normalized:
            raise GenrunError(f"{key} lists {base} twice; list each server once")
        normalized.append(base)
    return normalized


def _check_with_verl(rollout: DictConfig) -> None:
    """verl's RolloutConfig validates engine-specific limits (e.g. SGLang without pipeline
    parallelism) when the replica is built; build it here so the refusal comes in the preflight."""
    from verl.utils.config import omega_conf_to_dataclass

    try:
        omega_conf_to_dataclass(rollout)
    except Exception as exc:  # noqa: BLE001 - hydra wraps verl's error; its innermost message is the one to show
        innermost: BaseException = exc
        while innermost.__cause__ is not None:
            innermost = innermost.__cause__
        raise GenrunError(
            f"verl refuses this rollout config (actor_rollout_ref.rollout.*): {str(innermost).splitlines()[0]}"
        ) from None


def checked_hf_device(cfg: DictConfig) -> str:
    """The transformers engine's device (engine_kwargs.hf_device decides it), or a GenrunError."""
    return check_hf_device(
        hf_device(HfEngineKwargs.of(cfg.actor_rollout_ref.rollout.engine_kwargs).device, cfg.trainer.get("device"))
    )


def check_engine_installed(engine: str) -> None:
    """verl imports the engine's server class in the driver: refuse before anything starts."""
    if engine not in ENGINE_PACKAGES:
        return
    module, how = ENGINE_PACKAGES[engine]
    if importlib.util.find_spec(module) is None:
        raise GenrunError(
            f"rollout.name={engine} needs the {module} package on the driver and on every GPU node of the Ray "
            f"cluster; {how}; or use rollout.name=hf (transformers) or rollout.name=remote (servers already running)"
        )


def check_cluster_resources(
    layout: ReplicaLayout, cluster_resources: dict[str, float], where: str = "the Ray cluster"
) -> None:
    """Refuse a layout the Ray cluster cannot place: verl waits on its placement groups with no
    timeout, so a missing GPU (or CPU: verl's bundles hold 2 CPUs per GPU) would hang the run.
    `where`: whose resources these are, for the message (this machine, where the run starts Ray)."""
    if not layout.total_gpus:
        return
    have_gpus = int(cluster_resources.get("GPU", 0))
    if have_gpus < layout.total_gpus:
        on_cpu = "set actor_rollout_ref.rollout.engine_kwargs.hf.device=cpu, " if layout.engine == "hf" else ""
        raise GenrunError(
            f"{layout.describe()} need {layout.total_gpus} GPU(s) but {where} has {have_gpus}; {on_cpu}start GPU workers "
            "(docs/clusters.md: Running on a Ray cluster), connect with ray_kwargs.ray_init.address=HEAD:6379, or lower "
            "trainer.n_gpus_per_node / trainer.nnodes"
        )
    replica_cpus = sum(bundle["CPU"] for group in layout.placement_groups for bundle in group) * layout.replicas
    needed = replica_cpus + SHARD_TASK_RESOURCES["num_cpus"]
    have_cpus = int(cluster_resources.get("CPU", 0))
    if have_cpus < needed:
        raise GenrunError(
            f"{layout.describe()} hold {replica_cpus:g} Ray CPUs (verl reserves {VERL_COLOCATE_COUNT} per GPU) and each "
            f"shard task needs {SHARD_TASK_RESOURCES['num_cpus']}, but {where} has {have_cpus} CPUs; give the "
            f"nodes more CPUs (ray start --num-cpus, or ray_kwargs.ray_init.num_cpus on one machine) or add a CPU worker node"
        )
