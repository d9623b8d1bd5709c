"""The job's devices on Ray: the nodes reserved at start, one placement group per node pinned to a
Ray node (`reserve_nodes`), and a worker group's or rollout replica's share of them
(`GroupDevices`, `device_pool`) as `async_rl.core.placement` plans it. A plain device count
instead places a group wherever Ray finds room.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import ray

from async_rl.core.placement import DeviceRange, Placement, PlacementError

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
