"""param_update stage: receives each new version's buckets and syncs them to every receiver.

The trainer's send thread asks here how to send each version (`open_version`: shared memory for
receivers on its Ray node, Ray's object store for the others) and announces its buckets
(`put_bucket`, `end_version`); actor_train sends one `NewWeights` per version through the inbox
when its gather is done. For each,
`OverlappedWeightSync` stages the buckets on the rollout servers and logp workers as they
arrive and loads the complete version (param_update/overlapped.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional

from param_update.overlapped import ActorReceiver, BucketRef, BucketStream, OverlappedWeightSync, Route, VersionEnd
from param_update.shared_buffer import SharedBucket
from state_machines.base import StateMachine


@dataclass
class NewWeights:
    """Version `version` is on its way (its buckets arrive through `put_bucket`)."""

    version: int
    started_at: float  # wall time (time.time()) when its gather began


class ParamUpdateStage(StateMachine):
    """Syncs every new version; keeps the per-part timings for the driver's metrics.

    Args:
        receivers: weight receivers (`param_update.overlapped.ActorReceiver`, `GPUReplicaReceiver`).
        generate_stage: handle told the served version after each load.
        max_buckets_in_flight: buckets announced but not yet staged everywhere.
        timeout_s: one wait in a sync (a bucket, a receiver call) may take this long.
    """

    def __init__(self, receivers, generate_stage, max_buckets_in_flight: int = 4, timeout_s: float = 300.0,
                 restartable_servers: bool = False, server_timeout_s: float | None = None):
        """`restartable_servers`: a rollout server lost during a sync (gone, or silent for `server_timeout_s`,
        default `timeout_s`) is left out and reported to the generate stage, which restarts it;
        `replace_rollout_server` then loads the newest version into the new one
        (async_rl/replica_supervisor.py)."""
        super().__init__("param_update", inbox_size=1)
        self.stream = BucketStream(max_buckets_in_flight)
        self.generate_stage = generate_stage
        self.weight_sync = OverlappedWeightSync(receivers, generate_stage, self.stream, timeout_s,
                                                on_lost=self._server_lost if restartable_servers else None,
                                                lost_after_s=server_timeout_s)
        self.synced_version = 0
        self.timings: dict[int, dict[str, float]] = {}
        self._server_setup: tuple = ()

    # ---- rollout servers restarted by the generate stage ------------------------------------
    async def configure_rollout_servers(self, *setup_args) -> None:
        """Set up weight staging on every rollout receiver for the trainer's layout (a mismatch fails
        here, naming the server); `setup_args` = (dual, consume_bytes, layout, partial), kept for the
        servers restarted later."""
        self._server_setup = setup_args
        await asyncio.gather(*(self._configure(r) for r in self.weight_sync.receivers if r.serves_generation))

    async def _configure(self, receiver) -> None:
        """A CPU server's `configure_weight_sync`, or the checkpoint engines of a verl GPU replica's workers."""
        if isinstance(receiver, ActorReceiver):
            await receiver.handle.configure_weight_sync.remote(*self._server_setup)
        else:
            dual, _, layout, _ = self._server_setup
            await receiver.configure(layout, dual)

    def _server_lost(self, receiver, cause: str, hung: bool) -> None:
        self.generate_stage.server_lost.remote(receiver.replica_index, receiver.handle, cause, hung)

    async def replace_rollout_server(self, index: int, handle, replica_actors: tuple | None = None) -> int:
        """Set up the restarted server of replica `index`, load the newest synced version into it (between
        syncs) and sync it from now on. Returns the version it serves. `replica_actors`: (workers, servers)
        of a restarted verl GPU replica, whose workers receive the weights."""
        if replica_actors is None:
            receiver = ActorReceiver(f"rollout_server_{index}", handle, True, replica_index=index)
        else:
            old = next(r for r in self.weight_sync.receivers if getattr(r, "replica_index", None) == index)
            receiver = old.restarted(*replica_actors)
        await self._configure(receiver)
        version = await self.weight_sync.replace(receiver)
        return self.synced_version if version is None else version

    # ---- called by the trainer's send thread -------------------------------------------
    async def open_version(self, version: int, sender_node: str) -> Route:
        """How to send `version` (param_update/overlapped.py); waits for a free shared-memory region."""
        return await self.weight_sync.open_version(version, sender_node)

    async def put_bucket(self, version: int, index: int, refs: Optional[list], slices: list,
                         shared: Optional[SharedBucket] = None) -> None:
        """Announce one bucket; returns when there is room for it (backpressure on the sender)."""
        await self.stream.put_bucket(BucketRef(version, index, refs, slices, shared))

    def end_version(self, version: int, num_buckets: int, trainer_timings: dict, shared_only: tuple = ()) -> None:
        """The last of `version`'s `num_buckets` buckets was sent; `shared_only`: (index, slices, SharedBucket)
        of those sent only into shared memory (not announced by `put_bucket`)."""
        buckets = [BucketRef(version, index, None, slices, shared, counted=False)
                   for index, slices, shared in shared_only]
        self.stream.end_version(VersionEnd(version, num_buckets, trainer_timings), buckets)

    def sender_failed(self, version: int, message: str) -> None:
        self.stream.fail(version, message)

    # ---- the state machine ---------------------------------------------------------------
    async def process_data(self, data: NewWeights) -> None:
        self.timings[data.version] = await self.weight_sync.sync(data.version, data.started_at)
        self.synced_version = data.version  # nothing flows downstream: receivers are called directly

    def pop_timings(self) -> dict[int, dict[str, float]]:
        out, self.timings = self.timings, {}
        return out
