"""CPU rollout replica, the class verl builds for ``actor_rollout_ref.rollout.name=cpu`` once the backend is
registered (async_rl/rollout/cpu/registration.py). Each replica is one
:class:`CPURolloutServer` Ray actor that asks Ray for logical CPUs only, never GPUs: standalone
for this pipeline, hybrid for verl's own (synchronous) trainer, whose ranks send it weights.
"""

from __future__ import annotations

import ray
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from async_rl.rollout.cpu.reward_server import CPURewardModelServer
from async_rl.rollout.cpu.server import CPURolloutServer


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
