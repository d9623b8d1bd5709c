"""CPU rollout replica and its registration in verl's rollout replica registry.

After :func:`register_cpu_rollout`, ``actor_rollout_ref.rollout.name=cpu`` makes verl's
``get_rollout_replica_class`` (and thus ``LLMServerManager``) build :class:`CPURolloutReplica`,
and verl's trainer ranks build the worker-side :class:`CPUServerAdapter`. Each replica is one
:class:`CPURolloutServer` Ray actor that asks Ray for logical CPUs only, never GPUs: standalone
for this pipeline, hybrid for verl's own (synchronous) trainer, whose ranks send it weights.
"""

from __future__ import annotations

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry

from async_rl.rollout.cpu.reward_server import CPURewardModelServer
from async_rl.rollout.cpu.server import CPURolloutServer

CPU_ROLLOUT_NAME = "cpu"


class CPURolloutReplica(RolloutReplica):
    """One CPU rollout server per replica.

    Class attribute ``num_cpus`` is the logical CPUs each server actor requests from Ray (torch then
    uses as many intra-op threads as Ray's ``OMP_NUM_THREADS`` allows).
    """

    num_cpus: float = 1
    bundle: tuple | None = None  # (placement group, bundle index) of its device, set by the pipeline's placement
    reward_port: int | None = None  # a reward model's HTTP port, kept across restarts (verl's router keeps it)

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def init_standalone(self):
        """Start the server actor directly: no resource pool, no GPU bundles, no worker group."""
        self.rollout_mode = RolloutMode.STANDALONE
        self.workers = []
        await self.launch_servers()

    async def init_colocated(self, resource_pool=None):
        """Same as standalone: a CPU server has no accelerator to share, so the pool is not used."""
        self.rollout_mode = RolloutMode.COLOCATED
        self.workers = []
        await self.launch_servers()

    async def init_hybrid(self, worker_group):
        """verl's trainer: this replica's slice of the trainer ranks feeds its server weights
        (through CPUServerAdapter); the server runs beside them, in its own process."""
        self.rollout_mode = RolloutMode.HYBRID
        self.workers = worker_group.workers[self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)]
        await self.launch_servers()

    async def init_hybrid_colocated(self, worker_group, resource_pool):
        await self.init_hybrid(worker_group)

    def _server_name(self) -> str:
        if self.is_reward_model:
            kind = "reward_"
        elif self.is_teacher_model:
            kind = "teacher_"
        else:
            kind = ""
        return f"cpu_rollout_server_{kind}{self.replica_rank}{self.name_suffix}"

    async def launch_servers(self):
        """Create the server actor (on its device's bundle when placed; a reward model's serves verl's
        `/classify` over HTTP: async_rl/rollout/cpu/reward_server.py), load the model and record its
        handle and address."""
        placed = {}
        if self.bundle is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group, index = self.bundle
            placed["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, index)
        server = (
            ray.remote(CPURewardModelServer if self.is_reward_model else CPURolloutServer)
            .options(name=self._server_name(), num_cpus=self.num_cpus, num_gpus=0, max_concurrency=self.max_concurrency,
                     **placed)
            .remote(
                config=self.config,
                model_config=self.model_config,
                replica_rank=self.replica_rank,
                rollout_mode=self.rollout_mode,
                **({"port": self.reward_port} if self.is_reward_model else {}),
            )
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        address, port = await server.get_server_address.remote()
        self._server_address = f"{address}:{port}"
        if self.is_reward_model:
            self.reward_port = port


    async def relaunch(self, attempt: int):
        """A fresh server for this replica after the old one was lost (async_rl/rollout/supervisor.py):
        named `..._restart<attempt>` (the lost actor's name may not be free yet), model loaded from the
        model path; the caller loads the newest weights into it before it serves. Returns its handle."""
        self.name_suffix = f"_restart{attempt}"
        await self.launch_servers()
        return self._server_handle


def _load_cpu_replica() -> type[RolloutReplica]:
    return CPURolloutReplica


def register_cpu_rollout() -> None:
    """Register ``"cpu"`` in verl's two rollout registries (idempotent): the replica
    (:class:`CPURolloutReplica`) and the trainer ranks' adapter (:class:`CPUServerAdapter`;
    verl keeps that table as a module dict, `_ROLLOUT_REGISTRY`, with no register function)."""
    from verl.workers.rollout import base as rollout_base

    RolloutReplicaRegistry.register(CPU_ROLLOUT_NAME, _load_cpu_replica)
    rollout_base._ROLLOUT_REGISTRY[(CPU_ROLLOUT_NAME, "async")] = "async_rl.rollout.cpu.adapter.CPUServerAdapter"
