"""verl's rollout replicas (vllm, sglang, trtllm) on the pipeline's devices: made from verl's
`RolloutReplicaRegistry`, started standalone on the job's reserved bundles, started again on them
when lost, and their weights received through this package's verl checkpoint-engine backend."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from typing import Optional

import ray
from omegaconf import DictConfig
from verl.single_controller.ray import RayWorkerGroup
from verl.utils.device import get_device_name
from verl.workers.rollout.replica import RolloutMode

from async_rl.core.config import CPU_DEVICE
from async_rl.core.devices import device_pool
from async_rl.rollout.supervisor import kill_actor
from param_update.receivers import VerlReplicaReceiver
from param_update.verl_engine import use_staged_checkpoint_engine


def replica_world_size(rollout_cfg) -> int:
    """Devices one replica spans (tp x dp x pp), as verl's RolloutReplica computes it."""
    return (
        int(rollout_cfg.tensor_model_parallel_size)
        * int(rollout_cfg.get("data_parallel_size", 1) or 1)
        * int(rollout_cfg.get("pipeline_model_parallel_size", 1) or 1)
    )


def make_rollout_replicas(config: DictConfig, count: int) -> list:
    """`count` replica objects (not started)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.replica import get_rollout_replica_class

    rollout_cfg = config.actor_rollout_ref.rollout
    replica_cls = get_rollout_replica_class(rollout_cfg.name)
    model_cfg = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    return [
        replica_cls(
            replica_rank=rank,
            config=rollout_cfg,
            model_config=model_cfg,
            gpus_per_node=int(config.trainer.n_gpus_per_node),
        )
        for rank in range(count)
    ]


async def start_on_devices(replica, devices) -> None:
    """Start `replica` standalone on `devices` (async_rl.core.devices.GroupDevices): verl's
    `init_standalone` with the job's reserved bundles instead of a pool of its own."""
    replica.rollout_mode = RolloutMode.STANDALONE
    replica.resource_pool = device_pool(devices, True, f"rollout_pool_{replica.replica_rank}")
    await _start_workers_and_servers(replica, f"rollout_standalone_{replica.replica_rank}")


async def _start_workers_and_servers(replica, name_prefix: str) -> None:
    """verl's standalone start on `replica.resource_pool`: its worker group, then its servers."""
    def make_workers():  # verl's RayWorkerGroup waits for its actors: off the event loop
        return RayWorkerGroup(
            resource_pool=replica.resource_pool, ray_cls_with_init=replica.get_ray_class_with_init_args(),
            bin_pack=False, name_prefix=name_prefix, use_gpu=True, device_name=get_device_name(),
        ).workers

    replica.workers = await asyncio.to_thread(make_workers)
    replica.servers = []
    await replica.launch_servers()


async def relaunch_on_devices(replica, attempt: int, name_free_timeout_s: float = 60.0):
    """A lost verl GPU replica (vllm) started again on its reserved devices (async_rl/rollout/supervisor.py).

    Its server and worker actors are killed; once the servers' names are free, new workers take the
    same bundles and the servers start under the same names (verl's server adapter finds its server
    by name). The caller loads the newest weights before it serves: verl's servers start on
    `load_format=dummy` weights. Returns the new server handle."""
    names = [f"{replica._get_server_name_prefix()}server_{replica.replica_rank}_{node}{replica.name_suffix}"
             for node in range(len(replica.servers) or 1)]
    for actor in [*replica.servers, *replica.workers]:
        kill_actor(actor)

    def wait_names_free():
        deadline = time.monotonic() + name_free_timeout_s
        for name in names:
            while True:
                try:
                    ray.get_actor(name)
                except ValueError:
                    break  # no live actor holds the name
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the lost server's actor name {name!r} was not freed within "
                                       f"{name_free_timeout_s:g} s")
                time.sleep(0.2)

    await asyncio.to_thread(wait_names_free)
    await _start_workers_and_servers(replica, f"rollout_standalone_{replica.replica_rank}_restart{attempt}")
    return replica.server_handle


def launch_rollout_replicas(replicas: list, backend, devices: list, timeout_s: float) -> list:
    """Start `replicas` standalone, one GroupDevices each, through `backend.start`; fails with a
    clear error after `timeout_s` (s)."""

    async def start_all():
        await asyncio.wait_for(asyncio.gather(*(backend.start(r, d) for r, d in zip(replicas, devices))), timeout_s)

    try:
        asyncio.run(start_all())
    except asyncio.TimeoutError as exc:
        raise RuntimeError(f"rollout backend {backend.name!r} did not start within {timeout_s:g} s") from exc
    return replicas


def announce_to_prometheus(config: DictConfig, replicas: list) -> None:
    """verl's `rollout.prometheus`: with `enable`, verl's `update_prometheus_config` writes the replicas' server
    addresses as the `rollout` scrape targets into `prometheus.file` on every node and asks the Prometheus at
    `prometheus.port` to reload, as verl's separate-async trainer does once its servers are up (a failure is
    logged by verl, not raised: Prometheus is an observer). Called again after a replica restarts."""
    prometheus = config.actor_rollout_ref.rollout.prometheus
    if not prometheus.get("enable", False):
        return
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.utils import update_prometheus_config

    update_prometheus_config(omega_conf_to_dataclass(prometheus), [replica._server_address for replica in replicas],
                             str(config.actor_rollout_ref.rollout.name))


def start_standalone(replicas: list, timeout_s: float, what: str) -> None:
    """Start verl `replicas` standalone (`init_standalone`: servers of their own), all at once; TimeoutError
    naming `what` when they are not up within `timeout_s` (s)."""

    async def start_all():
        await asyncio.gather(*(replica.init_standalone() for replica in replicas))

    try:
        asyncio.run(asyncio.wait_for(start_all(), timeout=timeout_s))
    except asyncio.TimeoutError as exc:
        raise TimeoutError(f"{what} was not up within {timeout_s:g} s") from exc


def receiver(index: int, replica, partial: bool, replica_index: Optional[int], drain=None) -> VerlReplicaReceiver:
    """The weight receiver of a started verl replica (its workers stage the buckets)."""
    return VerlReplicaReceiver(f"rollout_replica_{index}", replica, partial, replica_index, drain)


def prepare_config(config: DictConfig, consume_bucket_mb: float, dual_buffer: bool) -> None:
    """verl's replicas load through this package's checkpoint-engine backend (param_update/verl_engine.py)."""
    use_staged_checkpoint_engine(config, consume_bucket_mb, dual_buffer)


def gpu_server_unavailable(package: str, install: str, device: str) -> Optional[str]:
    """Why verl's GPU server of `package` cannot run with `trainer.device=device` (what is allowed
    instead), or None."""
    if device == CPU_DEVICE:
        return f"cpu on trainer.device=cpu ({package} runs verl's GPU server)"
    if importlib.util.find_spec(package) is None:
        return f"a backend whose package is installed (it needs {package!r}: {install}, with your torch version pinned)"
    return None


def sglang_unavailable(device: str) -> Optional[str]:
    return gpu_server_unavailable("sglang", "pip install 'verl-async-rl[sglang]'", device)


def trtllm_unavailable(device: str) -> Optional[str]:
    return gpu_server_unavailable("tensorrt_llm", "pip install tensorrt_llm", device)
