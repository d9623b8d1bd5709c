"""The CPU backend's names in verl's two rollout registries, without loading the backend.

After :func:`register_cpu_rollout`, ``actor_rollout_ref.rollout.name=cpu`` makes verl's
``get_rollout_replica_class`` (and thus ``LLMServerManager``) build
:class:`async_rl.rollout.cpu.replica.CPURolloutReplica`, and verl's trainer ranks build the worker-side
``CPUServerAdapter``. Both are loaded only when verl asks for them: this module loads in the Ray workers
of every CPU run, most of which never build a replica.
"""

from __future__ import annotations

CPU_ROLLOUT_NAME = "cpu"
CPU_SERVER_ADAPTER = "async_rl.rollout.cpu.adapter.CPUServerAdapter"  # verl's rollout table takes a path


def load_cpu_replica() -> type:
    """The replica class, for verl's registry (loaded on its first use)."""
    # imported here: the replica loads the CPU engine and its servers, which only a replica's user needs
    from async_rl.rollout.cpu.replica import CPURolloutReplica

    return CPURolloutReplica


def register_cpu_rollout() -> None:
    """Register ``"cpu"`` in verl's two rollout registries (idempotent): the replica and the trainer ranks'
    adapter (verl keeps that table as a module dict, `_ROLLOUT_REGISTRY`, with no register function)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(CPU_ROLLOUT_NAME, load_cpu_replica)
    rollout_base._ROLLOUT_REGISTRY[(CPU_ROLLOUT_NAME, "async")] = CPU_SERVER_ADAPTER
