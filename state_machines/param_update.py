"""param_update stage: receives each new version's buckets and syncs them to every receiver.

The trainer's send thread asks here how to send each version (`open_version`: its route, the
transports its receivers' links need) and announces its buckets (`put_bucket`, `end_version`);
actor_train sends one `NewWeights` per version through the inbox when its gather is done. For
each, `OverlappedWeightSync` stages the buckets on the rollout servers and logp workers as they
arrive and loads the complete version (param_update/sync.py).
"""

from __future__ import annotations

import asyncio

from async_rl.api.weights import BucketRef, ReceiverSetup
from async_rl.core.messages import NewWeights
from param_update.sync import BucketStream, OverlappedWeightSync, VersionEnd
from state_machines.base import StateMachine


class ParamUpdateStage(StateMachine):
    """Syncs every new version; keeps the per-part timings for the driver's metrics.

    Args:
        receivers: WeightReceivers (param_update/receivers.py), the rollout replicas' first.
        clock: the policy clock's handle (async_rl/core/policy_clock.py): told each version once it is
            served, and of the rollout servers a sync finds lost.
        max_buckets_in_flight: buckets announced but not yet staged everywhere.
        timeout_s: one wait in a sync (a bucket, a receiver call) may take this long.
    """

    def __init__(self, *, receivers, clock, max_buckets_in_flight: int = 4, timeout_s: float = 300.0,
                 restartable_servers: bool = False, server_timeout_s: float | None = None, transports=None):
        """`restartable_servers`: a rollout server lost during a sync (gone, or silent for `server_timeout_s`,
        default `timeout_s`) is left out and reported to the clock, whence the generate stage restarts it;
        `replace_rollout_server` then loads the newest version into the new one
        (async_rl/rollout/supervisor.py). `transports`: the weight transport classes to choose links from
        (default: those registered in this process)."""
        super().__init__("param_update", inbox_size=1)
        self.stream = BucketStream(max_buckets_in_flight)
        self.policy_clock = clock
        self.weight_sync = OverlappedWeightSync(receivers, clock, self.stream, timeout_s,
                                                on_lost=self._server_lost if restartable_servers else None,
                                                lost_after_s=server_timeout_s, transports=transports, trace=self.trace)
        self.synced_version = 0
        self.timings: dict[int, dict[str, float]] = {}
        self._server_setup: ReceiverSetup | None = None

    # ---- rollout servers restarted by the generate stage ------------------------------------
    async def configure_rollout_servers(self, setup: ReceiverSetup) -> None:
        """Set up weight staging on every rollout receiver for the trainer's layout (a mismatch fails
        here, naming the server); `setup` is kept for the servers restarted later."""
        self._server_setup = setup
        await asyncio.gather(*(r.configure(setup) for r in self.weight_sync.receivers if r.serves_generation))

    def _server_lost(self, receiver, cause: str, hung: bool) -> None:
        self.policy_clock.report_lost.remote(receiver.replica_index, receiver.handle, cause, hung)

    async def replace_rollout_server(self, index: int, handle, replica_actors: tuple | None = None) -> int:
        """Set up the restarted server `handle` of replica `index`, load the newest synced version into it
        (between syncs) and sync it from now on. Returns the version it serves. `replica_actors`:
        (workers, servers) of a restarted verl replica, whose workers receive the weights."""
        old = next(r for r in self.weight_sync.receivers if r.replica_index == index)
        receiver = old.restarted(handle, replica_actors)
        if self._server_setup is None:
            raise RuntimeError("a rollout server was replaced before configure_rollout_servers set them up")
        await receiver.configure(self._server_setup)
        version = await self.weight_sync.replace(receiver)
        return self.synced_version if version is None else version

    # ---- called by the trainer's send thread -------------------------------------------
    async def open_version(self, version: int, sender_node: str):
        """How to send `version`: its `Route` (param_update/sync.py); may wait for room."""
        return await self.weight_sync.open_version(version, sender_node)

    async def put_bucket(self, version: int, index: int, handles: dict, slices: list) -> None:
        """Announce one bucket (transport name -> its handle); returns when there is room for it
        (backpressure on the sender)."""
        await self.stream.put_bucket(BucketRef(version, index, slices, handles))

    def end_version(self, version: int, num_buckets: int, trainer_timings: dict, at_end: tuple = (),
                    whole: tuple = ()) -> None:
        """The last of `version`'s `num_buckets` buckets was sent; `at_end`: the BucketRefs of those
        announced only now (not by `put_bucket`); `whole`: a delta's whole version, kept for restarts."""
        self.stream.end_version(VersionEnd(version, num_buckets, trainer_timings, tuple(whole)), tuple(at_end))

    def sender_failed(self, version: int, message: str) -> None:
        self.stream.fail(version, message)

    # ---- the state machine ---------------------------------------------------------------
    async def process_data(self, data: NewWeights) -> None:
        self.timings[data.version] = await self.weight_sync.sync(data.version, data.started_at)
        self.synced_version = data.version  # nothing flows downstream: receivers are called directly

    def pop_timings(self) -> dict[int, dict[str, float]]:
        out, self.timings = self.timings, {}
        return out
