"""Which devices of which node each stage's workers use (`trainer.use_nodes_ratios`).

A job has T = `trainer.nnodes` x `trainer.n_gpus_per_node` (G) devices (GPUs; on CPU, worker
processes), numbered node by node: device d is local device d % G of node d // G.

- generate takes floor(r_generate x T) devices, a whole number of rollout replicas, from the
  end: whole nodes where the ratio allows, every replica inside one node.
- the training roles in use (train, critic, logp, ref_logp) each take floor(r x T) devices, at
  least one, from the rest (the training devices). When they fit there side by side they get
  devices of their own, packed from device 0 in that order; otherwise they share the
  training devices, as the proposal's [0.5, 0.5, 0.5, 0.5] does: train, logp and ref_logp on
  one half, generate on the other.
- a group on several nodes takes whole nodes: verl's worker groups and FSDP's device mesh
  need the same number of ranks on every node, so a size above G must be a multiple of G.

verl's standalone rollout (`actor_rollout_ref.rollout.nnodes` > 0, as verl's separate-async trainer
places it: `rollout.nnodes` nodes of their own for generation after the `trainer.nnodes` training
nodes) is the job of both pools with the ratios `standalone_rollout_ratios` gives: generate on the
rollout nodes, the training roles sharing the trainer's.

A split that cannot work raises `PlacementError` at start, naming the key and the nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RATIOS_KEY = "trainer.use_nodes_ratios"
TRAINING_ROLES = ("train", "critic", "logp", "ref_logp")  # packing order on the training devices


class PlacementError(ValueError):
    """`trainer.use_nodes_ratios` cannot be placed on the job's nodes."""


def _devices(ratio: float, total: int) -> int:
    """floor(ratio x total), a product within rounding of a whole number counting as that number."""
    return math.floor(ratio * total + 1e-9)


def standalone_rollout_ratios(trainer_nodes: int, rollout_nodes: int) -> tuple[float, float, float, float]:
    """`use_nodes_ratios` (train, logp, ref_logp, generate) of a job of `trainer_nodes` + `rollout_nodes` nodes:
    generate on the last `rollout_nodes`, the training roles sharing the first `trainer_nodes`."""
    total = trainer_nodes + rollout_nodes
    train = trainer_nodes / total
    return train, train, train, rollout_nodes / total


@dataclass(frozen=True)
class DeviceRange:
    """`count` consecutive devices from global device index `start`."""

    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count

    def nodes(self, per_node: int) -> list[int]:
        """Indices of the nodes these devices are on."""
        return list(range(self.start // per_node, (self.stop - 1) // per_node + 1))


@dataclass(frozen=True)
class Placement:
    """Where every worker group and rollout replica goes.

    groups: training role -> its devices. replicas: one device range per rollout replica.
    shared: whether the training roles share their devices (each device then hosts one
    worker of every role: `colocate_count` of them).
    """

    nodes: int
    devices_per_node: int
    groups: dict[str, DeviceRange]
    replicas: tuple[DeviceRange, ...]
    shared: bool

    @property
    def colocate_count(self) -> int:
        """The most worker processes on one device."""
        return len(self.groups) if self.shared else 1

    def world_size(self, role: str) -> int:
        return self.groups[role].count

    def metrics(self) -> dict[str, float]:
        """`async/devices/<role>` (devices per training role and for generate), `async/devices/shared`
        (1: the training roles share theirs): logged with every step, read by `python -m async_rl.plan`."""
        out = {f"async/devices/{role}": float(r.count) for role, r in self.groups.items()}
        out["async/devices/generate"] = float(sum(r.count for r in self.replicas))
        out["async/devices/shared"] = float(self.shared)
        return out

    def describe(self) -> str:
        """One line per node: which roles' devices are on it."""
        lines = []
        for node in range(self.nodes):
            used = [f"{role} x{self._on_node(r, node)}" for role, r in self.groups.items() if self._on_node(r, node)]
            served = sum(1 for r in self.replicas if node in r.nodes(self.devices_per_node))
            used += [f"generate x{served} replica(s)"] if served else []
            lines.append(f"node {node}: " + (", ".join(used) or "idle"))
        return "; ".join(lines)

    def _on_node(self, devices: DeviceRange, node: int) -> int:
        first, stop = node * self.devices_per_node, (node + 1) * self.devices_per_node
        return max(0, min(stop, devices.stop) - max(first, devices.start))


def _check_shape(role: str, devices: DeviceRange, per_node: int, ratio: float) -> None:
    """A group inside one node, or on whole nodes."""
    inside_one = devices.start // per_node == (devices.stop - 1) // per_node
    whole_nodes = devices.start % per_node == 0 and devices.count % per_node == 0
    if not (inside_one or whole_nodes):
        raise PlacementError(
            f"invalid config: {RATIOS_KEY} gives {role} {devices.count} devices (ratio {ratio}) on nodes "
            f"{devices.nodes(per_node)} of {per_node} devices each; a group on several nodes needs whole nodes "
            f"(the same number of ranks on each): choose a ratio giving at most {per_node} devices or a multiple of it"
        )


def plan_placement(nodes: int, devices_per_node: int, ratios: dict[str, float], roles: list[str],
                   replica_devices: int) -> Placement:
    """The placement of `roles` (training roles in use) and the rollout replicas; PlacementError if none works.

    ratios: role -> share of all devices (`AsyncPipelineConfig.ratios_by_role`).
    replica_devices: devices one rollout replica spans (tp x dp x pp).
    """
    per_node, total = devices_per_node, nodes * devices_per_node
    where = f"{nodes} node(s) x {per_node} devices (trainer.nnodes x trainer.n_gpus_per_node)"
    if replica_devices > per_node or per_node % replica_devices:
        raise PlacementError(f"invalid config: a rollout replica spans {replica_devices} devices "
                             f"(actor_rollout_ref.rollout.tensor_model_parallel_size), which must divide the "
                             f"{per_node} devices of a node")
    generate = max(replica_devices, _devices(ratios["generate"], total) // replica_devices * replica_devices)
    training = total - generate
    if training < 1 and generate == replica_devices:  # one replica already takes every device
        raise PlacementError(
            f"invalid config: one rollout replica spans {replica_devices} devices "
            f"(actor_rollout_ref.rollout.tensor_model_parallel_size x data_parallel_size x pipeline_model_parallel_size), "
            f"all {total} of {where}: the async pipeline generates and trains at the same time, each on devices of its "
            f"own, so it needs more devices than one replica spans: use more devices or a smaller replica")
    if training < 1:
        raise PlacementError(f"invalid config: {RATIOS_KEY} gives generate {generate} of the {total} devices of "
                             f"{where}, leaving none to train on: lower the generate ratio (the 4th number)")
    replicas = tuple(DeviceRange(training + i * replica_devices, replica_devices)
                     for i in range(generate // replica_devices))
    sizes = {role: max(1, _devices(ratios[role], total)) for role in TRAINING_ROLES if role in roles}
    shared = sum(sizes.values()) > training
    groups, cursor = {}, 0
    for role, size in sizes.items():
        if size > training:
            raise PlacementError(
                f"invalid config: {RATIOS_KEY} gives {role} {size} devices (ratio {ratios[role]}) but generate "
                f"leaves {training} of the {total} devices of {where} to the training roles")
        start = 0 if shared else cursor
        if not shared and (size > per_node or start // per_node != (start + size - 1) // per_node):
            start = -(-start // per_node) * per_node  # next node boundary: whole nodes, or inside one
        groups[role] = DeviceRange(start, size)
        cursor = start + size
    if not shared and cursor > training:  # alignment left no room side by side: share instead
        shared, groups = True, {role: DeviceRange(0, size) for role, size in sizes.items()}
    for role, devices in groups.items():
        _check_shape(role, devices, per_node, ratios[role])
    return Placement(nodes, per_node, groups, replicas, shared)
