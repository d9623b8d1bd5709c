"""verl worker groups for the stages, on the devices `async_rl.placement` gives them.

The job's nodes are reserved at start, one placement group per node pinned to a Ray node
(`reserve_nodes`); a worker group or rollout replica then gets its devices' bundles of those
(`GroupDevices`). A plain device count instead places the group wherever Ray finds room.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray
from omegaconf import DictConfig

from async_rl.placement import DeviceRange, Placement, PlacementError

NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class GroupDevices:
    """A worker group's devices among the job's reserved nodes.

    node_groups: one Ray placement group per job node (`reserve_nodes`), `per_node` bundles each.
    colocate_count: worker processes sharing one device (each takes 1/colocate_count of a GPU).
    """

    node_groups: tuple
    devices: DeviceRange
    per_node: int
    colocate_count: int = 1

    @property
    def world_size(self) -> int:
        return self.devices.count

    def bundle(self, rank: int) -> tuple:
        """(placement group, bundle index) of the group's `rank`-th device."""
        device = self.devices.start + rank
        return self.node_groups[device // self.per_node], device % self.per_node


def world_size_of(devices: "int | GroupDevices") -> int:
    return devices if isinstance(devices, int) else devices.world_size


def device_bundle(on_cpu: bool, colocate_count: int) -> dict[str, float]:
    """One device's bundle: a GPU (on CPU, none) and a logical CPU per process sharing it."""
    return {"CPU": float(colocate_count)} if on_cpu else {"GPU": 1.0, "CPU": float(colocate_count)}


def pick_nodes(nodes: list[dict], count: int, per_node: int, bundle: dict[str, float], first_id: str = "",
               hint: str = "") -> list[dict]:
    """The `count` Ray nodes (`ray.nodes()` entries) the job uses: alive, with room for `per_node`
    bundles; `first_id` (the driver's node) first if it has room, then by address and id. `hint`
    ends the error's list of remedies."""
    def fits(node):
        return node.get("Alive") and all(node["Resources"].get(k, 0) >= v * per_node for k, v in bundle.items())

    ordered = sorted(nodes, key=lambda n: (n["NodeID"] != first_id, n.get("NodeManagerAddress", ""), n["NodeID"]))
    chosen = [n for n in ordered if fits(n)][:count]
    if len(chosen) < count:
        seen = "; ".join(f"{n['NodeID'][:8]} ({n.get('NodeManagerAddress', '?')}): "
                         + ", ".join(f"{k} {n['Resources'].get(k, 0):g}" for k in bundle)
                         + ("" if n.get("Alive") else ", dead") for n in ordered)
        need = ", ".join(f"{k} {v * per_node:g}" for k, v in bundle.items())
        raise PlacementError(
            f"trainer.nnodes={count} needs {count} Ray nodes with {need} each (trainer.n_gpus_per_node={per_node} "
            f"devices), Ray has {len(chosen)} such node(s): {seen}; lower trainer.nnodes or "
            f"trainer.n_gpus_per_node or trainer.use_nodes_ratios, or add nodes{hint}")
    return chosen


def reserve_nodes(placement: Placement, on_cpu: bool, timeout_s: float) -> tuple[tuple, list[str]]:
    """One STRICT_PACK placement group of `devices_per_node` bundles per job node, each pinned to its
    Ray node; returns (the groups, their Ray node ids). PlacementError naming the node when Ray cannot
    reserve it within `timeout_s`."""
    from ray.util.placement_group import placement_group, remove_placement_group

    bundle = device_bundle(on_cpu, placement.colocate_count)
    per_node = placement.devices_per_node
    nodes = pick_nodes(ray.nodes(), placement.nodes, per_node, bundle, ray.get_runtime_context().get_node_id(),
                       (" (on CPU, logical CPUs: ray_kwargs.ray_init.num_cpus)" if on_cpu else "")
                       + ("; to join a running cluster set RAY_ADDRESS or +ray_kwargs.ray_init.address=auto"
                          if placement.nodes > 1 else ""))
    groups = tuple(
        placement_group([dict(bundle) for _ in range(per_node)], strategy="STRICT_PACK", name=f"async_rl_{os.getpid()}_node_{i}",
                        bundle_label_selector=[{NODE_ID_LABEL: node["NodeID"]}] * per_node)
        for i, node in enumerate(nodes)
    )
    deadline = time.monotonic() + timeout_s
    for i, (group, node) in enumerate(zip(groups, nodes)):
        if not group.wait(max(1.0, deadline - time.monotonic())):
            for g in groups:
                remove_placement_group(g)
            raise PlacementError(
                f"could not reserve {per_node} devices ({bundle} each) on node {i} ({node['NodeID'][:8]}, "
                f"{node.get('NodeManagerAddress', '?')}) within {timeout_s:g} s: other jobs hold its resources")
    return groups, [node["NodeID"] for node in nodes]


def _prepare_platform(config: DictConfig) -> bool:
    """Whether the run is on CPU (`trainer.device`); if so, verl's CPU platform and engine class
    are selected in the driver before any worker group is built."""
    on_cpu = str(config.trainer.device) == "cpu"
    if on_cpu:
        from verl_patches.cpu_patches import set_engine_device_env, use_cpu_platform

        use_cpu_platform()
        set_engine_device_env()
    return on_cpu


def device_pool(devices: "int | GroupDevices", use_gpu: bool, name: str):
    """verl resource pool for `devices`: its bundles of the reserved nodes, or a new pool of that many.
    `use_gpu`: its workers ask for accelerators (verl's RayWorkerGroup checks the pool allows it)."""
    from verl.single_controller.ray import RayResourcePool
    from verl.single_controller.ray.base import SubRayResourcePool

    if isinstance(devices, int):
        return RayResourcePool([devices], use_gpu=use_gpu, max_colocate_count=1, name_prefix=name)
    return SubRayResourcePool(
        placement_groups=list(devices.node_groups), start_bundle_index=devices.devices.start,
        subgroup_world_size=devices.world_size, process_on_nodes=[devices.per_node] * len(devices.node_groups),
        use_gpu=use_gpu, max_colocate_count=devices.colocate_count, name_prefix=name,
    )


def _worker_group(on_cpu: bool, devices: "int | GroupDevices", name: str, remote_cls, **init_args):
    """verl `RayWorkerGroup` of `remote_cls(on_cpu=..., **init_args)` on `devices`."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup

    pool = device_pool(devices, not on_cpu, name)
    worker_cls = RayClassWithInitArgs(cls=remote_cls, on_cpu=on_cpu, **init_args)
    return RayWorkerGroup(pool, worker_cls, name_prefix=name, device_name="cpu" if on_cpu else "cuda")


def make_worker_group(config: DictConfig, role: str, devices: "int | GroupDevices", name: str):
    """verl `RayWorkerGroup` of `PipelineWorker` (role `actor` or `ref`), models initialised."""
    from async_rl.workers import CONCURRENCY_GROUPS, PipelineWorker

    on_cpu = _prepare_platform(config)
    group = _worker_group(on_cpu, devices, name, ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(PipelineWorker),
                          config=config.actor_rollout_ref, role=role)
    group.init_model()
    return group


def critic_worker_config(config: DictConfig):
    """verl's critic config -> the `TrainingWorkerConfig` verl's trainer builds from it (value model,
    engine with the critic's token budgets, optimizer, checkpoint contents), and the `CriticConfig`
    (its loss settings)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import TrainingWorkerConfig

    critic_cfg = omega_conf_to_dataclass(config.critic)
    engine = critic_cfg.engine
    engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    worker_cfg = TrainingWorkerConfig(
        model_type="value_model",
        model_config=critic_cfg.model,
        engine_config=engine,
        optimizer_config=critic_cfg.optim,
        checkpoint_config=critic_cfg.checkpoint,
    )
    return worker_cfg, critic_cfg


def make_critic_worker_group(config: DictConfig, devices: "int | GroupDevices"):
    """verl `RayWorkerGroup` of the critic (`async_rl.workers.CriticWorker`), engine built and its
    loss verl's `value_loss`, as verl's trainer sets it up."""
    from functools import partial

    from verl.workers.utils.losses import value_loss

    from async_rl.workers import CriticWorker

    on_cpu = _prepare_platform(config)
    worker_cfg, critic_cfg = critic_worker_config(config)
    group = _worker_group(on_cpu, devices, "critic", ray.remote(CriticWorker), config=worker_cfg)
    group.reset()
    group.set_loss_fn(partial(value_loss, config=critic_cfg))
    return group
