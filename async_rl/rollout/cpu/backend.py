"""This package's CPU rollout backend as a pipeline backend row (async_rl/rollout/backends.py): one
`CPURolloutServer` actor per replica on its device's bundle, receiving weights as an
`ActorReceiver` (shared memory on the trainer's node), restarted in place when lost."""

from __future__ import annotations

from typing import Optional

from async_rl.rollout.cpu.options import CpuEngineOptions
from async_rl.rollout.cpu.replica import CPURolloutReplica
from param_update.receivers import ActorReceiver

__all__ = ["CPURolloutReplica", "check_config", "read_digests", "receiver", "relaunch", "start"]


def check_config(config, consume_bucket_mb: float, dual_buffer: bool) -> None:
    """The engine's own options (`actor_rollout_ref.rollout.engine_kwargs.cpu`) read before any worker starts,
    so a wrong one is refused naming its key (AsyncConfigError)."""
    CpuEngineOptions.from_rollout_config(config.actor_rollout_ref.rollout)


async def start(replica: CPURolloutReplica, devices) -> None:
    """Its server actor on the bundle of its one device (an async_rl.core.devices.GroupDevices)."""
    replica.bundle = devices.bundle(0)
    await replica.init_standalone()


def receiver(index: int, replica: CPURolloutReplica, partial: bool, replica_index: Optional[int]) -> ActorReceiver:
    """The server's weight receiver (`partial` is the server's own setting: `configure_weight_sync`)."""
    return ActorReceiver(f"rollout_server_{index}", replica.server_handle, True, replica_index=replica_index)


async def relaunch(replica: CPURolloutReplica, attempt: int):
    return await replica.relaunch(attempt)


async def read_digests(server) -> dict[str, str]:
    return await server.weight_digests.remote()
