"""Contract of a rollout backend: what the pipeline needs to know about the servers
`actor_rollout_ref.rollout.name` picks, as one table row instead of string compares.

The generate stage only ever calls `generate` on a replica's server handle (verl's server
interface), so backends differ only in how their replicas start, receive weights and restart.
Backends register by name (`register_rollout_backend`); async_rl/rollout/backends.py holds the
built-in table (cpu, vllm, sglang, trtllm).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional

from async_rl.core.errors import AsyncConfigError


def _one_device(rollout_cfg) -> int:
    return 1


def _available(device: str) -> Optional[str]:
    return None


def _nothing(*args) -> None:
    return None


def _no_env(config) -> dict:
    return {}


@dataclass(frozen=True)
class RolloutBackend:
    """One rollout backend. Callables are module-level functions (the row travels to Ray actors).

    name: `actor_rollout_ref.rollout.name`.
    start: `async start(replica, devices)`: start one verl `RolloutReplica` standalone on its reserved
        devices (an async_rl.core.devices.GroupDevices).
    make_receiver: `make_receiver(index, replica, partial_rollout, replica_index) -> WeightReceiver` of a
        started replica (`replica_index`: set when lost replicas are restarted).
    relaunch: `async relaunch(replica, attempt) -> server handle`: a lost replica started again on its
        devices (its weights are loaded after); None: a lost replica is not restarted.
    read_digests: `async read_digests(server handle) -> {HF name: digest}` of the weights it serves;
        None: not readable.
    waits_for_running: a weight load can wait for running requests (`partial_rollout=False`).
    starts_on_dummy_weights: its servers start on random weights: version 0 is synced before anything
        generates.
    default_max_restarts: `actor_rollout_ref.rollout.max_restarts` when unset.
    receivers_tell_nodes: its receivers report their Ray nodes (same-node transports can reach them);
        else they read through the object store.
    replica_world_size: devices one replica spans, from the rollout config.
    unavailable: why it cannot run with `trainer.device` (a message naming what to install or set),
        or None.
    prepare_config: `prepare_config(config, consume_bucket_mb, dual_buffer)`: rewrite the verl config
        (in place) before any worker starts.
    prepare_server_config: `prepare_server_config(rollout_cfg, device)`: rewrite one server config (a
        reward model's `reward.reward_model.rollout`) for `trainer.device`, in place.
    ray_env: environment variables every Ray process of the run needs, from the config.
    logical_gpus_on_cpu: on trainer.device=cpu its replicas ask Ray for (logical) GPUs.
    serves_images: its servers take a prompt's images (`image_data`), so rows with images (verl's
        `data.image_key` column) can run; else such data is refused at start.
    gpu_server: it runs verl's GPU server (vllm, sglang, trtllm), whose replicas need devices: a reward
        model on it takes devices of its own (`reward.reward_model.nnodes x n_gpus_per_node`); else (this
        package's CPU engine) its reward-model replicas run on logical CPUs beside the workers.
    loads_deltas: its receivers keep the version they serve as a delta's base, and delta sync
        (`param_update_delta_sync`) has run through them end to end; else that key is refused at start.
    replica_class: verl `RolloutReplica` class to register in verl's registry under `name` (None:
        verl has it).
    """

    name: str
    start: Callable[[Any, Any], Awaitable[None]]
    make_receiver: Callable[[int, Any, bool, Optional[int]], Any]
    relaunch: Optional[Callable[[Any, int], Awaitable[Any]]] = None
    read_digests: Optional[Callable[[Any], Awaitable[dict]]] = None
    waits_for_running: bool = False
    starts_on_dummy_weights: bool = False
    default_max_restarts: int = 0
    receivers_tell_nodes: bool = False
    replica_world_size: Callable[[Any], int] = _one_device
    unavailable: Callable[[str], Optional[str]] = _available
    prepare_config: Callable[[Any, float, bool], None] = _nothing
    prepare_server_config: Callable[[Any, str], None] = _nothing
    ray_env: Callable[[Any], dict] = _no_env
    logical_gpus_on_cpu: bool = False
    serves_images: bool = False
    gpu_server: bool = False
    loads_deltas: bool = False
    replica_class: Optional[type] = None


NAME_KEY = "actor_rollout_ref.rollout.name"
_BACKENDS: dict[str, RolloutBackend] = {}


def register_rollout_backend(backend: RolloutBackend) -> RolloutBackend:
    """Make `backend` available as `actor_rollout_ref.rollout.name=<backend.name>` (and its replica
    class in verl's registry, when it brings one)."""
    if backend.replica_class is not None:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        replica_class = backend.replica_class
        RolloutReplicaRegistry.register(backend.name, lambda: replica_class)
    _BACKENDS[backend.name] = backend
    return backend


def registered_backends() -> list[RolloutBackend]:
    """Every registered backend, in registration order."""
    return list(_BACKENDS.values())


def rollout_backend(name: str, device: Optional[str] = None, key: str = NAME_KEY) -> RolloutBackend:
    """The backend registered as `name`; AsyncConfigError naming `key` (the config key that chose it)
    when there is none or, given `device` (`trainer.device`), when it cannot run there."""
    if name not in _BACKENDS:
        raise AsyncConfigError(key, name, f"one of {sorted(_BACKENDS)}")
    backend = _BACKENDS[name]
    reason = backend.unavailable(str(device)) if device is not None else None
    if reason:
        raise AsyncConfigError(key, name, reason)
    return backend
