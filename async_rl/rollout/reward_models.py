"""A reward model for the pipeline (`reward.reward_model.enable=True`): verl's reward-model replicas
and verl's router in front of them, started once per run; the reward stage and validation score
through the router with verl's own reward loop (async_rl/core/reward_loop_scoring.py).

Where its replicas run (`reward_model_devices`):
- the CPU backend (`reward.reward_model.rollout.name=cpu`): as many replicas as verl's trainer would
  start (the devices verl gives the reward model over one replica's tp x dp x pp), one process each on
  a logical CPU, none of the pipeline's devices; a lost server is started again on the same address
  (verl's router keeps its list), up to `actor_rollout_ref.rollout.max_restarts` times each.
- a GPU server (vllm): `reward.reward_model.nnodes x n_gpus_per_node` devices of its own, verl's
  standalone reward pool (`enable_resource_pool=True`, required: the pipeline's devices are all busy at
  once, so there is no phase to colocate it in); `trainer.use_nodes_ratios` still splits the trainer's
  devices alone. A lost server is started again by verl's `init_standalone` on freed devices, at a new
  address, and verl's router is started again on its own address with the new list (`relaunch_standalone`).
Each row's deadline (`reward.async_timeout_s`) holds on every backend.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
from ray.util.placement_group import remove_placement_group

import async_rl.rollout.backends  # noqa: F401 - registers the rollout backends (the reward model's is one)
from async_rl.api.rollout import rollout_backend
from async_rl.rollout.reward_router import launch_router
from async_rl.rollout.supervisor import kill_actor
from async_rl.rollout.verl_replicas import replica_world_size, start_standalone

logger = logging.getLogger(__name__)
PING_TIMEOUT_S = 10.0  # a server that does not answer its address within this long is lost
WATCH_PERIOD_S = 1.0
BACKEND_KEY = "reward.reward_model.rollout.name"


def reward_model_backend(config):
    """The rollout backend row serving the reward model (AsyncConfigError naming BACKEND_KEY when it cannot
    run on `trainer.device`)."""
    return rollout_backend(str(config.reward.reward_model.rollout.name), str(config.trainer.device), BACKEND_KEY)


def on_devices_of_its_own(config) -> bool:
    """Whether the reward model takes devices of its own (its backend's `gpu_server`), not logical CPUs
    (the CPU backend)."""
    rm = config.reward.reward_model
    return bool(rm.get("enable", False)) and rollout_backend(str(rm.rollout.name), key=BACKEND_KEY).gpu_server


def reward_model_devices(config) -> int:
    """Devices the reward model takes beside the trainer's `nnodes x n_gpus_per_node` (0: none)."""
    rm = config.reward.reward_model
    return int(rm.n_gpus_per_node) * int(rm.nnodes) if on_devices_of_its_own(config) else 0


def prepare_reward_model_config(config) -> None:
    """Before Ray starts: the reward model's backend rewrites its server config for `trainer.device`
    (vLLM's CPU build: no sleep mode), in place."""
    if config.reward.reward_model.get("enable", False):
        reward_model_backend(config).prepare_server_config(config.reward.reward_model.rollout, str(config.trainer.device))


def reward_model_replica_count(config) -> int:
    """Replicas verl's RewardModelManager would start for `config` (at least 1)."""
    rm, trainer = config.reward.reward_model, config.trainer
    if rm.get("enable_resource_pool", False):  # required on a GPU server (async_rl/core/verl_keys.py)
        devices = int(rm.n_gpus_per_node) * int(rm.nnodes)
    else:
        devices = int(trainer.n_gpus_per_node) * int(trainer.nnodes)
    return max(1, devices // replica_world_size(rm.rollout))


def free_replica(replica) -> None:
    """Kill a replica's servers and workers and free a GPU server's standalone pool (verl's)."""
    for actor in [*replica.servers, *replica.workers]:
        kill_actor(actor)
    if replica.resource_pool is not None:
        for group in replica.resource_pool.pgs or []:
            remove_placement_group(group)


async def relaunch_in_place(replica, attempt: int) -> None:
    """The CPU backend: a new server on the lost one's address (`CPURolloutReplica.relaunch`)."""
    await replica.relaunch(attempt)


async def relaunch_standalone(replica, attempt: int) -> None:
    """A GPU server (vllm): the lost replica's actors killed and devices freed, then verl's
    `init_standalone` under names of its own (`_restart<attempt>`): a new address."""
    free_replica(replica)
    replica.name_suffix = f"_restart{attempt}"
    replica.servers, replica.workers, replica.resource_pool = [], [], None
    await replica.init_standalone()


@dataclass
class RewardModelService:
    """The run's reward-model replicas (verl `RolloutReplica`s, `is_reward_model=True`) and the address
    of verl's router in front of them ("ip:port")."""

    router_address: str
    replicas: list = field(default_factory=list)
    router_process: Any = None
    max_restarts: int = 0  # per replica
    restarts: list = field(default_factory=list)  # per replica, so far
    standalone: bool = False  # GPU servers on devices of their own: restarted at a new address, the router following
    _stopped: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """Restart lost servers from a daemon thread until `stop` (a replica past its restarts is left out:
        verl's router then fails its requests, which the reward stage names)."""
        self.restarts = [0] * len(self.replicas)
        threading.Thread(target=self._watch, daemon=True, name="reward-model-watch").start()

    def _watch(self) -> None:
        while not self._stopped.wait(WATCH_PERIOD_S):
            for index, replica in enumerate(self.replicas):
                if self._stopped.is_set() or self.restarts[index] >= self.max_restarts or self._alive(replica):
                    continue
                self.restarts[index] += 1
                logger.warning("reward model replica %d lost: restart %d of %d (actor_rollout_ref.rollout.max_restarts)",
                               index, self.restarts[index], self.max_restarts)
                try:
                    relaunch = relaunch_standalone if self.standalone else relaunch_in_place
                    asyncio.run(relaunch(replica, self.restarts[index]))
                    if self.standalone:
                        self._restart_router()
                except Exception:  # noqa: BLE001 - the next round tries again, within the restarts left
                    logger.exception("reward model replica %d did not start again", index)

    def _restart_router(self) -> None:
        """verl's router, which keeps the list it started with, started again on its address with the
        replicas' addresses now (rows its predecessor failed are retried by verl's client; rows sent while
        it starts wait in its queue)."""
        self._stop_router()
        started, urls = time.monotonic(), self.worker_urls()
        _, self.router_process = launch_router(self.router_address, urls)
        logger.warning("verl's reward-model router started again on %s in %.1f s, serving %s", self.router_address,
                       time.monotonic() - started, ", ".join(urls))

    def worker_urls(self) -> list[str]:
        return [f"http://{replica.server_address}" for replica in self.replicas]

    def _stop_router(self) -> None:
        if self.router_process is not None and self.router_process.is_alive():
            self.router_process.kill()
            self.router_process.join(timeout=10)

    @staticmethod
    def _alive(replica) -> bool:
        try:
            ray.get(replica.servers[0].get_server_address.remote(), timeout=PING_TIMEOUT_S)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def stop(self) -> None:
        """Kill the servers, their workers and the router, and free their devices (idempotent)."""
        self._stopped.set()
        for replica in self.replicas:
            free_replica(replica)
        self._stop_router()


def start_reward_model(config, timeout_s: float, max_restarts: int = 0) -> Optional[RewardModelService]:
    """Start the reward model's replicas and verl's router, watched (`max_restarts` per replica), or None
    when `reward.reward_model.enable` is off. TimeoutError naming the model when they are not up within
    `timeout_s` (s)."""
    rm = config.reward.reward_model
    if not rm.get("enable", False):
        return None
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    # the backend's own replica class (the CPU backend's), else the one verl registers
    replica_cls = reward_model_backend(config).replica_class or get_rollout_replica_class(rm.rollout.name)
    model_config = HFModelConfig(path=rm.model_path)
    replicas = [replica_cls(replica_rank=rank, config=rm.rollout, model_config=model_config,
                            gpus_per_node=int(rm.get("n_gpus_per_node") or 1), is_reward_model=True)
                for rank in range(reward_model_replica_count(config))]
    service = RewardModelService(router_address="", replicas=replicas, max_restarts=max_restarts,
                                 standalone=on_devices_of_its_own(config))

    try:
        start_standalone(replicas, timeout_s, f"the reward model ({rm.model_path})")
    except BaseException:
        service.stop()
        raise
    service.router_address, service.router_process = launch_router(None, service.worker_urls())
    if max_restarts:
        service.watch()
    return service
