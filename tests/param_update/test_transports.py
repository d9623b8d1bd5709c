"""The weight sync's built-in transports (param_update/transports/): shared memory on the trainer's
Ray node, a gloo group or the object store across nodes.

Without Ray: the shared buffer (bytes round trip, files unlinked, a dead run's files swept, a full
tmpfs) and the region handshake (a region still serving, syncing or retained is never handed out). With Ray: a CPU rollout server on
the trainer's node gets a version bit-identical with no object-store put, and the sender waits
while the region it would overwrite still serves; on a 2-node `ray.cluster_utils.Cluster` a
server on the other node gets it through the object store (a table without the collective), servers
there get every version bit-identical through the collective group, which is rebuilt when one is lost
and restarted, and a restarted server gets the newest version from the retained region, on either node.
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from async_rl.api.weights import Bucket, ReceiverSetup
from async_rl.core.errors import WeightSyncError
from param_update.buckets import pack_buckets, tensors_from_buckets
from param_update.transports.collective import Collective
from param_update.transports.object_store import ObjectStore
from param_update.transports.shared_memory import (
    PREFIX,
    RETAINED,
    RegionLedger,
    SharedBuffer,
    SharedMemory,
    byte_runs,
    shared_arrays,
    sweep_stale,
)
from sync_actors import (
    Trainer,
    VersionLog,
    digests,
    on_node,
    served,
    start_server,
    start_stage,
    sync,
    tiny_model,
    wait_for_timings,
)
from helpers.clusters import RAY_CALL_GUARD_S

SHM, STORE, COLLECTIVE = SharedMemory.name, ObjectStore.name, Collective.name

TIMEOUT_S = RAY_CALL_GUARD_S  # a hang guard, not a bound on how long a call takes


# ---- the shared buffer ------------------------------------------------------------------------


def mixed_tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("a", torch.randn(7, 5, generator=g)), ("empty", torch.zeros(0, 3)),
            ("half", torch.randn(33, generator=g).to(torch.bfloat16)), ("big", torch.randn(64, 64, generator=g)),
            ("scalar", torch.tensor(3.5))]


def through_buffer(buffer: SharedBuffer, tensors, region: int, bucket_bytes: int, pool=None) -> list[Bucket]:
    """Write every bucket into `region`, then read them back as a receiver does."""
    out = []
    for bucket in pack_buckets(tensors, bucket_bytes, version=1):
        shared = buffer.write(region, bucket, pool, parts=3)
        out.append(Bucket(1, bucket.index, shared_arrays(shared, bucket.slices), bucket.slices))
    return out


@pytest.mark.parametrize("bucket_bytes", [100, 4096, 1 << 20])
def test_shared_buffer_round_trip_is_bit_identical_and_rewrites_in_place(tmp_path, bucket_bytes):
    from concurrent.futures import ThreadPoolExecutor

    tmp_path.mkdir(exist_ok=True)
    buffer = SharedBuffer(str(tmp_path))
    with ThreadPoolExecutor(3) as pool:
        first = through_buffer(buffer, mixed_tensors(0), 0, bucket_bytes, pool)
        assert digests(dict(tensors_from_buckets(first))) == digests(dict(mixed_tensors(0)))
        assert not any(a.flags.writeable for b in first for a in b.data)  # receivers map read-only
        files = sorted(os.listdir(tmp_path))
        # the next version in the same region reuses the files: views mapped before see the new bytes
        through_buffer(buffer, mixed_tensors(1), 0, bucket_bytes, pool)
        assert sorted(os.listdir(tmp_path)) == files
        assert digests(dict(tensors_from_buckets(first))) == digests(dict(mixed_tensors(1)))
    buffer.close()
    assert os.listdir(tmp_path) == []


def test_byte_runs_split_the_bytes_in_order_into_about_equal_runs():
    import numpy as np

    arrays = [np.arange(n, dtype=np.uint8) for n in (10, 0, 3, 20)]
    runs = byte_runs(arrays, 4)
    assert [sum(len(p) for _, p in run) for run in runs] == [9, 9, 9, 6]
    joined = np.zeros(33, dtype=np.uint8)
    for run in runs:
        for offset, piece in run:
            joined[offset : offset + len(piece)] = piece
    assert (joined == np.concatenate(arrays)).all()
    assert byte_runs([np.zeros(0, dtype=np.uint8)], 4) == []


def test_sweep_removes_only_the_files_of_runs_whose_sender_is_gone(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = tmp_path / f"{PREFIX}{dead.stdout.strip()}-abc-r0-b0"
    live = tmp_path / f"{PREFIX}{os.getpid()}-def-r1-b0"
    other = tmp_path / "psm_unrelated"
    for path in (stale, live, other):
        path.write_bytes(b"x")
    assert sweep_stale(str(tmp_path)) == [str(stale)]
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name])
    stale.write_bytes(b"x")
    SharedBuffer(str(tmp_path))  # a new sender sweeps too
    assert not stale.exists() and live.exists()


def test_a_full_tmpfs_fails_at_the_write_naming_the_room(tmp_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    tmp_path.mkdir(exist_ok=True)
    buffer = SharedBuffer(str(tmp_path))
    bucket = next(pack_buckets(mixed_tensors(0), 1 << 20, version=1))
    with pytest.raises(OSError, match="no room for .* MB of weights in"):
        buffer.write(0, bucket)
    assert os.listdir(tmp_path) == []


def test_a_gloo_group_carries_buckets_bit_identical_in_any_order(tmp_path):
    """Without Ray: the collective's sending side writes each bucket once into its shared buffer and sends
    it in a gloo group of two (the receiving rank joins in this process at its first read); the receiving
    side reads them last first, each arriving bit-identical."""
    from param_update.transports.collective import GroupTicket, ReceivingSide

    tmp_path.mkdir(exist_ok=True)
    collective = Collective(str(tmp_path))
    tensors = mixed_tensors(2)
    buckets = list(pack_buckets(tensors, 100, version=1))
    handles = [collective.write(GroupTicket(region=0, epoch=1, world=2), b) for b in buckets]
    assert [h.tag for h in handles] == list(range(len(buckets))) and len(buckets) > 3
    side = ReceivingSide()
    got = {b.index: Bucket(1, b.index, side.read(h, b.slices), b.slices)
           for b, h in reversed(list(zip(buckets, handles)))}
    assert digests(dict(tensors_from_buckets([got[i] for i in range(len(buckets))]))) == digests(dict(tensors))
    collective.close()
    assert os.listdir(tmp_path) == []


# ---- the region handshake -----------------------------------------------------------------------


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def not_handed_out(ledger: RegionLedger, version: int) -> bool:
    try:
        await ledger.acquire(version, timeout_s=0.2)
    except WeightSyncError as exc:
        assert "no shared-memory region free" in str(exc)
        return True
    return False


def test_a_region_serving_a_version_is_not_handed_out_until_every_receiver_loaded_a_later_one():
    """Dual buffer: version 3 may overwrite version 1's region only once both servers serve version 2."""
    async def main():
        ledger = RegionLedger()
        assert await ledger.acquire(1, 1.0) == 0
        ledger.loaded(1, ["a", "b"], keeping=["a", "b"])  # both serve version 1 from region 0
        assert await ledger.acquire(2, 1.0) == 1
        assert await not_handed_out(ledger, 3)  # region 0 serves, region 1 is syncing
        waiting = asyncio.ensure_future(ledger.acquire(3, 5.0))
        await asyncio.sleep(0.05)
        ledger.loaded(2, ["a"], keeping=["a"])  # b (still loading) serves version 1 from region 0
        await asyncio.sleep(0.05)
        assert not waiting.done()
        ledger.loaded(2, ["b"], keeping=["b"])
        assert await waiting == 0

    run(main())


def test_copying_receivers_free_the_region_at_load_and_a_failed_sync_frees_its_own():
    async def main():
        ledger = RegionLedger()
        assert await ledger.acquire(1, 1.0) == 0
        ledger.loaded(1, ["logp"], keeping=[])  # copied into its own memory: region 0 free at once
        assert await ledger.acquire(2, 1.0) == 0
        ledger.loaded(2, ["server"], keeping=["server"])
        assert await ledger.acquire(3, 1.0) == 1
        ledger.ended(3)  # version 3 dropped everywhere: version 2 keeps serving from region 0
        assert await ledger.acquire(4, 1.0) == 1
        assert await not_handed_out(ledger, 5)

    run(main())


def test_the_retained_version_and_a_lost_receiver():
    async def main():
        ledger = RegionLedger()
        await ledger.acquire(1, 1.0)
        ledger.loaded(1, ["a"], keeping=[])
        ledger.retain(1)  # restarts on: a restarted server loads version 1 from region 0
        assert ledger.users[0] == {RETAINED}
        assert await ledger.acquire(2, 1.0) == 1
        ledger.loaded(2, ["a"], keeping=["a"])
        assert await not_handed_out(ledger, 3)
        ledger.retain(2)
        assert await ledger.acquire(3, 1.0) == 0
        ledger.loaded(3, [], keeping=[])  # "a" was lost mid-sync: it still holds region 1 ...
        ledger.retain(3)
        assert await not_handed_out(ledger, 4)
        ledger.drop("a")  # ... until it is reported lost
        assert await ledger.acquire(4, 1.0) == 1

    run(main())


# ---- one call per version for shared-memory receivers (param_update/sync.py) -----------------


class RecordingReceiver:
    """A receiver that stages into a real VersionStager and records the calls it gets."""

    def __init__(self, name: str, link: str, expected: dict):
        from param_update.staging import WeightStaging

        self.name, self.link, self.serves_generation, self.replica_index = name, link, True, None
        self.staging = WeightStaging(expected)
        self.calls: list[tuple] = []

    async def stage(self, bucket) -> dict:
        self.calls.append(("stage", bucket.index))
        return self.staging.stage_bucket(bucket.version, bucket.index, bucket.handle_for(self.link), bucket.slices)

    async def stage_version(self, version: int, buckets: list, num_buckets: int) -> dict:
        self.calls.append(("stage_version", [b.index for b in buckets], num_buckets))
        return self.staging.stage_version(version, [(b.index, b.handle_for(self.link), b.slices) for b in buckets],
                                          num_buckets)

    async def check(self, version: int, num_buckets: int) -> None:
        self.calls.append(("check",))
        self.staging.check(version, num_buckets)

    async def commit(self, version: int, num_buckets: int) -> dict:
        self.calls.append(("commit",))
        self.staging.check(version, num_buckets)
        return {"load_s": 0.0, "blocked_s": 0.0}

    async def discard(self, version: int) -> None:
        self.calls.append(("discard",))


class ServedLog:
    """Stands in for the generate stage without Ray: `set_served_version.remote(version)` records it."""

    def __init__(self):
        self.versions = []

        async def remote(version):
            self.versions.append(version)

        self.set_served_version = SimpleNamespace(remote=remote)


def sync_by_link(tmp_path, announce, links):
    """Version 1 of `mixed_tensors` written into a shared buffer in `tmp_path`, announced by `announce(stream,
    buckets)`, synced to one receiver per link in `links` (SHM, STORE). Returns (receivers, log, bucket count,
    the sync's metrics or its WeightSyncError)."""
    from async_rl.api.weights import BucketRef
    from param_update.staging import weight_layout
    from param_update.sync import BucketStream, OverlappedWeightSync

    tensors = mixed_tensors(1)
    expected = weight_layout(dict(tensors))[0]
    tmp_path.mkdir(exist_ok=True)
    buffer = SharedBuffer(str(tmp_path))
    buckets = []
    for b in pack_buckets(tensors, 1500, 1):
        shared = buffer.write(0, b)  # the object store's handle here: the same bytes, read the same way
        buckets.append(BucketRef(1, b.index, b.slices, {link: shared for link in links}))
    receivers = [RecordingReceiver(link, link, expected) for link in links]
    stream, log = BucketStream(max_in_flight=2), ServedLog()
    sync = OverlappedWeightSync(receivers, log, stream, timeout_s=5.0)

    async def main():
        sending = asyncio.ensure_future(announce(stream, buckets))
        try:
            return await sync.sync(1, time.time())
        except WeightSyncError as exc:
            return exc
        finally:
            await sending

    try:
        return receivers, log, len(buckets), run(main())
    finally:
        buffer.close()


def test_a_shared_memory_receiver_gets_a_version_in_one_call_the_object_store_one_bucket_by_bucket(tmp_path):
    from param_update.sync import VersionEnd

    async def announce(stream, buckets):  # as the sender does when some receiver is on another node
        for bucket in buckets:
            await stream.put_bucket(bucket)
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))

    (shm, store), log, count, metrics = sync_by_link(tmp_path, announce, [SHM, STORE])
    assert count > 2  # more buckets than the stream lets in flight: each store staging frees its place
    assert shm.calls == [("stage_version", list(range(count)), count), ("commit",)]
    assert sorted(store.calls[:count]) == [("stage", i) for i in range(count)]
    assert store.calls[count:] == [("check",), ("commit",)]
    assert log.versions == [1] and metrics["async/param_update/shm_receivers"] == 1.0


def test_buckets_only_in_shared_memory_come_with_the_version_end_and_a_missing_one_fails_the_check(tmp_path):
    from dataclasses import replace

    from param_update.sync import VersionEnd

    def end_with(keep):
        async def announce(stream, buckets):  # as the sender does when every receiver is on its node
            shared_only = [replace(b, counted=False) for b in buckets if keep(b.index)]
            stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}), shared_only)
        return announce

    (shm,), log, count, metrics = sync_by_link(tmp_path / "all", end_with(lambda i: True), [SHM])
    assert shm.calls == [("stage_version", list(range(count)), count), ("commit",)]
    assert isinstance(metrics, dict) and log.versions == [1]  # no place in flight was freed that was never taken

    (shm,), log, count, error = sync_by_link(tmp_path / "one_lost", end_with(lambda i: i != 1), [SHM])
    assert isinstance(error, WeightSyncError)
    assert "recv + register-buffer + check of version 1 failed on receiver 'shm'" in str(error) and "[1]" in str(error)
    assert shm.calls[-1] == ("discard",) and ("commit",) not in shm.calls and log.versions == []


@pytest.mark.parametrize("link", [SHM, STORE])
def test_register_buffer_counts_the_check_where_a_delta_is_put_together(tmp_path, monkeypatch, link):
    """On the shared-memory link the check ends the one staging call; on the others it is the sync's own
    call: either way its seconds are register-buffer's."""
    from param_update.staging import VersionStager
    from param_update.sync import VersionEnd

    check_s, check = 0.3, VersionStager.check_complete

    def slow_check(self, version, num_buckets):
        time.sleep(check_s)
        check(self, version, num_buckets)

    async def announce(stream, buckets):
        for bucket in buckets:
            await stream.put_bucket(bucket)
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))

    monkeypatch.setattr(VersionStager, "check_complete", slow_check)
    (receiver,), log, _, metrics = sync_by_link(tmp_path, announce, [link])
    assert log.versions == [1] and ("stage_version" if link == SHM else "check") in [c[0] for c in receiver.calls]
    assert metrics["timing_s/param_update/register_buffer"] >= check_s


def test_a_verl_replica_counts_its_workers_check_in_register_buffer():
    from param_update.receivers import VerlReplicaReceiver

    check_s = 0.3

    async def execute(method, *args):
        if method == "check_weights":
            await asyncio.sleep(check_s)
            return None
        return {"recv_s": 0.01, "register_s": 0.02}

    worker = SimpleNamespace(execute_checkpoint_engine=SimpleNamespace(remote=execute))
    receiver = VerlReplicaReceiver("replica 0", SimpleNamespace(workers=[worker, worker]))
    bucket = SimpleNamespace(version=1, index=0, slices=[], handle_for=lambda link: None)
    totals = run(receiver.stage_version(1, [bucket, bucket], 2))
    assert totals["recv_s"] == pytest.approx(0.02) and totals["register_s"] >= 0.04 + check_s


# ---- through Ray ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("transport_model")
    tiny_model(0).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dual", [True, False])
def test_same_node_server_gets_the_version_through_shared_memory_without_a_put(small_objects_ray, model_dir, dual):
    server = start_server(model_dir, dual)
    stage = start_stage([server])
    trainer = Trainer.remote(seed=1)
    want = ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)
    request = server.generate.remote(prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 8}, request_id="r")
    timings = sync(stage, trainer, 1)
    assert served(server) == (1, want)
    assert ray.get(trainer.put_count.remote(), timeout=TIMEOUT_S) == 0  # nothing went through the object store
    assert (timings["async/param_update/shm_receivers"], timings["async/param_update/store_receivers"]) == (1, 0)
    assert timings["async/param_update/num_buckets"] > 1 and timings["async/param_update/step_wait_s"] >= 0
    files = ray.get(trainer.files.remote(), timeout=TIMEOUT_S)
    assert len(files) == timings["async/param_update/num_buckets"] and all("-r0-" in f for f in files)
    assert len(ray.get(request, timeout=TIMEOUT_S).token_ids) == 8
    ray.get(trainer.step.remote(), timeout=TIMEOUT_S)  # the next version goes to the other region
    sync(stage, trainer, 2)
    assert served(server) == (2, ray.get(trainer.digests.remote(), timeout=TIMEOUT_S))
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
    assert ray.get(trainer.files.remote(), timeout=TIMEOUT_S) == []  # unlinked; the server's views stay valid
    assert served(server)[1] == ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)


def test_the_sender_does_not_overwrite_the_region_a_server_serves(small_objects_ray, model_dir):
    """Version 2 is sent but not loaded, so the server serves version 1 from region 0 and version 2
    holds region 1: version 3's send waits, and the served weights stay version 1's bytes, until
    version 2 is loaded."""
    from async_rl.core.messages import NewWeights

    server = start_server(model_dir, True)
    stage = start_stage([server])
    trainer = Trainer.remote(seed=1)
    want = {1: ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)}
    sync(stage, trainer, 1, bucket_bytes=1 << 20)
    for version in (2, 3):
        ray.get(trainer.step.remote(), timeout=TIMEOUT_S)
        want[version] = ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)
        sending = trainer.send.remote(version, 1 << 20, stage)  # NewWeights(2) not given yet: 2 is not loaded
        if version == 2:
            ray.get(sending, timeout=TIMEOUT_S)
    ready, _ = ray.wait([sending], timeout=3.0)
    assert not ready, "version 3 was written while region 0 still served version 1"
    assert served(server) == (1, want[1])
    ray.get(stage.put.remote(NewWeights(2, time.time())), timeout=TIMEOUT_S)
    wait_for_timings(stage, 2)
    ray.get(sending, timeout=TIMEOUT_S)  # region 0 is free now
    ray.get(stage.put.remote(NewWeights(3, time.time())), timeout=TIMEOUT_S)
    wait_for_timings(stage, 3)
    assert served(server) == (3, want[3])
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)


# ---- two Ray nodes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 8, "include_dashboard": False})
    other = cluster.add_node(num_cpus=8)
    cluster.wait_for_nodes()
    yield cluster, cluster.head_node.node_id, other.node_id
    cluster.shutdown()


@pytest.fixture
def two_nodes(cluster):
    ray_cluster, head, other = cluster
    ray.init(address=ray_cluster.address)
    yield head, other
    ray.shutdown()


@pytest.mark.ray  # a Ray of its own
def test_a_server_on_another_node_gets_the_version_through_the_object_store(two_nodes, model_dir):
    """Two servers, one on the trainer's node and one on the other node: one sync, both links (a table
    without the collective: the object store is the cross-node link)."""
    head, other = two_nodes
    servers = [start_server(model_dir, True, head), start_server(model_dir, True, other)]
    stage = start_stage(servers, node_id=other, transports=[SharedMemory, ObjectStore])
    trainer = Trainer.options(**on_node(head)).remote(seed=1)
    want = ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)
    timings = sync(stage, trainer, 1)
    assert served(servers[0]) == served(servers[1]) == (1, want)
    assert (timings["async/param_update/shm_receivers"], timings["async/param_update/store_receivers"]) == (1, 1)
    assert ray.get(trainer.put_count.remote(), timeout=TIMEOUT_S) >= timings["async/param_update/num_buckets"]
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)

    # only a receiver on the other node (the one above, now version 2's only receiver): no shared buffer is made
    remote_only = start_stage([servers[1]], transports=[SharedMemory, ObjectStore])
    sender = Trainer.options(**on_node(head)).remote(seed=2)
    timings = sync(remote_only, sender, 2)
    assert (timings["async/param_update/shm_receivers"], timings["async/param_update/store_receivers"]) == (0, 1)
    assert ray.get(sender.files.remote(), timeout=TIMEOUT_S) == []
    assert served(servers[1]) == (2, ray.get(sender.digests.remote(), timeout=TIMEOUT_S))


@pytest.mark.ray  # a Ray of its own
def test_a_restarted_server_gets_the_newest_version_from_the_retained_region(two_nodes, model_dir):
    """Restarts on: version 1 went through shared memory only; a server restarted on the trainer's
    node stages it from the retained region, one restarted on the other node from the object store
    (copied there from the region on the trainer's node); the next version reaches it by its link."""
    head, other = two_nodes
    stage = start_stage([start_server(model_dir, True, head)], restartable=True)
    ray.get(stage.configure_rollout_servers.remote(ReceiverSetup(True, 4096)), timeout=TIMEOUT_S)
    trainer = Trainer.options(**on_node(head)).remote(seed=1)
    want = ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)
    sync(stage, trainer, 1)
    assert ray.get(trainer.put_count.remote(), timeout=TIMEOUT_S) == 0
    for node in (head, other):
        restarted = start_server(model_dir, True, node, configure=False)
        assert ray.get(stage.replace_rollout_server.remote(0, restarted), timeout=TIMEOUT_S) == 1
        assert served(restarted) == (1, want)
    ray.get(trainer.step.remote(), timeout=TIMEOUT_S)
    timings = sync(stage, trainer, 2)
    assert (timings["async/param_update/shm_receivers"], timings["async/param_update/collective_receivers"]) == (0, 1)
    assert served(restarted) == (2, ray.get(trainer.digests.remote(), timeout=TIMEOUT_S))
    assert ray.get(trainer.put_count.remote(), timeout=TIMEOUT_S) == 0
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)


@pytest.mark.ray  # a Ray of its own
def test_servers_on_another_node_get_every_version_through_a_group_rebuilt_across_a_restart(two_nodes, model_dir):
    """Restarts on, two servers on the other node: every version reaches both through the collective
    group bit-identical, nothing through the object store; one server dies, the next version reaches the
    survivor (the dead one is reported lost) and the server restarted in its place loads that version
    (carried from the sender's buffer); the version after reaches both through a new group."""
    head, other = two_nodes
    servers = [start_server(model_dir, True, other) for _ in range(2)]
    log = VersionLog.remote()
    stage = start_stage(servers, restartable=True, node_id=other, log=log)
    ray.get(stage.configure_rollout_servers.remote(ReceiverSetup(True, 4096)), timeout=TIMEOUT_S)
    trainer = Trainer.options(**on_node(head)).remote(seed=1)

    def next_version(version: int, receivers: int) -> dict:
        if version > 1:
            ray.get(trainer.step.remote(), timeout=TIMEOUT_S)
        timings = sync(stage, trainer, version)
        assert (timings["async/param_update/collective_receivers"], timings["async/param_update/store_receivers"],
                timings["async/param_update/shm_receivers"]) == (receivers, 0, 0)
        return ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)

    for version in (1, 2):
        want = next_version(version, receivers=2)
        assert served(servers[0]) == served(servers[1]) == (version, want)
    ray.kill(servers[1], no_restart=True)
    want = next_version(3, receivers=1)
    assert served(servers[0]) == (3, want)
    assert [index for index, _ in ray.get(log.lost.remote(), timeout=TIMEOUT_S)] == [1]
    restarted = start_server(model_dir, True, other, configure=False)
    assert ray.get(stage.replace_rollout_server.remote(1, restarted), timeout=TIMEOUT_S) == 3
    assert served(restarted) == (3, want)
    for version in (4, 5):
        want = next_version(version, receivers=2)
        assert served(servers[0]) == served(restarted) == (version, want)
    assert ray.get(trainer.put_count.remote(), timeout=TIMEOUT_S) == 0  # the restart's carry is a task's return
    ray.get(trainer.close.remote(), timeout=TIMEOUT_S)
