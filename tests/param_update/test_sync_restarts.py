"""A receiver lost during a sync and restarted (async_rl/rollout/supervisor.py): with `on_lost`, a CPU rollout
server or a verl replica that dies during a sync is reported and left out instead of failing it; `replace`
loads the kept version bit-identical into the restarted one, which takes its place in the next syncs."""

from __future__ import annotations

import asyncio
import time

import ray

from async_rl.api.weights import ReceiverSetup
from param_update.buckets import pack_buckets, tensor_digest
from param_update.receivers import ActorReceiver, VerlReplicaReceiver
from param_update.sync import BucketStream, OverlappedWeightSync, VersionEnd
from sync_actors import tiny_model
from sync_common import (TIMEOUT_S, DriverLog, FakeCheckpointEngineWorker, FakeReplica, announce, digests_of,
                         start_server)
from sync_common import model_dir, server_pool, version_0_servers  # noqa: F401 - fixtures of this module's tests


def test_a_lost_verl_replica_is_left_out_and_its_restart_loads_the_kept_version(small_objects_ray):
    """verl's replica (restartable): a load that meets its dead server leaves it out and reports it;
    the replica restarted with new workers (`VerlReplicaReceiver.restarted`) loads the kept version
    bit-identical and takes its place in the next syncs."""
    trained = tiny_model(1)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in trained.state_dict().items()}
    replica = FakeReplica([FakeCheckpointEngineWorker.remote()], servers=["old server"], dead_servers=["old server"])
    receiver = VerlReplicaReceiver("rollout_replica_0", replica, replica_index=0)
    lost = []
    stream = BucketStream(max_in_flight=64)
    sync = OverlappedWeightSync([receiver], DriverLog(), stream, timeout_s=30,
                                on_lost=lambda r, cause, hung: lost.append((r.replica_index, r.handle, cause)))
    buckets = list(pack_buckets(trained.state_dict().items(), 3000, version=1))
    refs = [[ray.put(b.data)] for b in buckets]
    new_workers = [FakeCheckpointEngineWorker.remote()]

    async def main():
        await receiver.configure(ReceiverSetup(True, 0, layout))
        await announce(stream, buckets, refs)
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))
        await sync.sync(1, time.time())  # the load meets the dead server: left out, not a failure
        restarted = receiver.restarted("new server", (new_workers, ["new server"]))
        await restarted.configure(ReceiverSetup(True, 0, layout))
        return restarted, await sync.replace(restarted)

    restarted, version = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert lost == [(0, "old server", "ActorDiedError during load")]
    assert version == 1 and restarted.handle == "new server" and sync.receivers == [restarted]
    loaded, calls = ray.get(new_workers[0].get.remote(), timeout=TIMEOUT_S)
    assert loaded == {n: tensor_digest(t) for n, t in trained.state_dict().items()} and calls == [("update_weights", 1)]
    assert receiver.replica.servers == ["old server"]  # the lost replica's own record is left as it was


def test_lost_restartable_server_is_left_out_then_its_restart_gets_the_newest_version(version_0_servers, model_dir):
    """With `on_lost`, a server that dies during a sync is reported instead of failing the sync; the
    survivor loads the version; `replace` loads that same version into the restarted server (from
    the kept buckets) and the next sync reaches it."""
    servers = version_0_servers(2, dual=True, keep=False)
    log = DriverLog()
    lost = []
    stream = BucketStream(max_in_flight=64)
    receivers = [ActorReceiver(f"server_{i}", s, True, replica_index=i) for i, s in enumerate(servers)]
    sync = OverlappedWeightSync(receivers, log, stream, timeout_s=30.0,
                                on_lost=lambda receiver, cause, hung: lost.append((receiver.name, cause)))

    def buckets_of(seed: int, version: int):
        buckets = list(pack_buckets(tiny_model(seed).state_dict().items(), 2048, version=version))
        return buckets, [ray.put(b.data) for b in buckets]

    async def version_1_killing_server_1():
        buckets, refs = buckets_of(1, 1)
        await announce(stream, buckets[:2], refs[:2])
        await asyncio.sleep(0.5)
        ray.kill(servers[1], no_restart=True)
        await announce(stream, buckets[2:], refs[2:])
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))
        return await sync.sync(1, time.time())

    timings = asyncio.run(asyncio.wait_for(version_1_killing_server_1(), TIMEOUT_S))
    assert timings["async/param_update/num_buckets"] >= 3
    assert [name for name, _ in lost] == ["server_1"] and "ActorDiedError" in lost[0][1]
    assert log.get() == [1]
    want_1 = {n: tensor_digest(t) for n, t in tiny_model(1).state_dict().items()}
    assert digests_of(servers[0]) == want_1

    restarted = start_server(model_dir, True)
    version = asyncio.run(asyncio.wait_for(
        sync.replace(ActorReceiver("server_1", restarted, True, replica_index=1)), TIMEOUT_S))
    assert version == 1
    assert ray.get(restarted.get_param_version.remote(), timeout=TIMEOUT_S) == 1
    assert digests_of(restarted) == want_1

    async def version_2():
        buckets, refs = buckets_of(2, 2)
        await announce(stream, buckets, refs)
        stream.end_version(VersionEnd(2, len(buckets), {"gather": 0.0, "send": 0.0}))
        return await sync.sync(2, time.time())

    asyncio.run(asyncio.wait_for(version_2(), TIMEOUT_S))
    want_2 = {n: tensor_digest(t) for n, t in tiny_model(2).state_dict().items()}
    assert digests_of(servers[0]) == digests_of(restarted) == want_2
    assert len(lost) == 1
