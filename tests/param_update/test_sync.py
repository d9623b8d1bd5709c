"""The weight sync through Ray: trainer send thread -> object store -> param_update -> CPU rollout servers.

Real Ray actors: two CPU rollout servers (the engine serving requests), the param_update
stage, a trainer actor running the bucket sender. Failures: a lost bucket, a receiver
that dies, a bucket that never comes, a send that fails; each leaves the previous
version serving, so those tests share their servers (`ServerPool`: each test gets them serving
version 0, asserted). Also the `async_rl` checkpoint-engine backend under verl's own manager (its
send side, as verl's fully_async_policy uses it): bit-identical weights, a failed or missing send.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from types import SimpleNamespace

import pytest
import ray
import transformers

from async_rl.api.weights import BucketRef, ReceiverSetup, Route
from async_rl.core.errors import WeightSyncError
from async_rl.core.messages import NewWeights
from async_rl.core.trace import TraceRecorder
from async_rl.rollout.cpu.server import CPURolloutServer
from param_update.buckets import pack_buckets, tensor_digest
from param_update.receivers import ActorReceiver, VerlReplicaReceiver
from param_update.sync import BucketStream, OverlappedWeightSync, VersionEnd
from param_update.transports.object_store import ObjectStore, StoredBucket, split_arrays
from state_machines.base import END_OF_STREAM
from state_machines.param_update import ParamUpdateStage
from sync_actors import Trainer, VersionLog, tiny_model, wait_for_timings

TIMEOUT_S = 120
# the actors below live in this file: Ray pickles them by value, whatever name pytest imported it under
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync_model")
    tiny_model(0).save_pretrained(path)
    return str(path)


def start_server(model_dir: str, dual: bool, **options):
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(name="cpu", tensor_model_parallel_size=1, prompt_length=8, response_length=8)
    server = ray.remote(CPURolloutServer).options(max_concurrency=64, **options).remote(
        config=config, model_config=HFModelConfig(path=model_dir, load_tokenizer=False)
    )
    ray.get(server.launch_server.remote(), timeout=TIMEOUT_S)
    ray.get(server.configure_weight_sync.remote(dual, 4096), timeout=TIMEOUT_S)
    return server


def digests_of(server) -> dict:
    return ray.get(server.weight_digests.remote(), timeout=TIMEOUT_S)


class DriverLog:
    """VersionLog for a sync run in this process (OverlappedWeightSync driven directly): records
    `set_served_version.remote(version)` without an actor of its own."""

    def __init__(self):
        self.versions = []

        async def remote(version):
            self.versions.append(version)

        self.set_served_version = SimpleNamespace(remote=remote)

    def get(self) -> list:
        return list(self.versions)


class ServerPool:
    """CPU rollout servers serving version 0, shared by this module's tests: a new server is a process
    importing torch and verl, seconds of CPU each. They are detached Ray actors (each test's driver,
    `small_objects_ray`, goes at the test's end; they stay), found again by name.

    `servers(count, dual)` hands a test `count` of them, each asserted to serve version 0 with the model's
    own weights and its staging set up afresh (`configure_weight_sync(dual)`: whatever a failed sync
    before left staged is dropped); pooled servers that are gone (a test killed one) are replaced by
    new ones. A test that changes what they serve takes them with `keep=False`: the pool forgets them.
    Every server it started is killed at the module's end."""

    def __init__(self, address: str, model_dir: str):
        self.address, self.model_dir = address, model_dir
        self.namespace = f"test_sync_servers_{uuid.uuid4().hex[:8]}"
        self.pooled: list[str] = []  # names of the servers serving version 0
        self.started: list[str] = []  # names of every server started, to kill at the end
        self.original = None

    def _lookup(self, name: str):
        try:
            server = ray.get_actor(name, namespace=self.namespace)
            ray.get(server.get_param_version.remote(), timeout=TIMEOUT_S)
            return server
        except (ValueError, ray.exceptions.RayActorError):
            return None  # killed by a test

    def servers(self, count: int, dual: bool, keep: bool = True) -> list:
        if self.original is None:
            model = transformers.AutoModelForCausalLM.from_pretrained(self.model_dir)
            self.original = {n: tensor_digest(t) for n, t in model.state_dict().items()}
        alive = [(name, server) for name, server in ((n, self._lookup(n)) for n in self.pooled) if server is not None]
        live, rest = alive[:count], [name for name, _ in alive[count:]]
        while len(live) < count:
            name = f"server_{len(self.started)}"
            self.started.append(name)
            live.append((name, start_server(self.model_dir, dual, name=name, namespace=self.namespace,
                                            lifetime="detached")))
        self.pooled = rest  # until they pass the checks: a server that fails them is not handed out again
        handed = [server for _, server in live]
        ray.get([s.configure_weight_sync.remote(dual, 4096) for s in handed], timeout=TIMEOUT_S)
        for server in handed:  # what a test of this module starts from
            assert ray.get(server.get_param_version.remote(), timeout=TIMEOUT_S) == 0
            assert digests_of(server) == self.original
        if keep:
            self.pooled = [name for name, _ in live] + rest
        return handed

    def close(self) -> None:
        if not self.started:
            return
        connected = ray.is_initialized()
        if not connected:
            ray.init(address=self.address)
        try:
            for name in self.started:
                try:
                    ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
                except ValueError:
                    pass  # already gone
        finally:
            if not connected:
                ray.shutdown()


@pytest.fixture(scope="module")
def server_pool(small_objects_ray_address, model_dir):
    pool = ServerPool(small_objects_ray_address, model_dir)
    yield pool
    pool.close()


@pytest.fixture
def version_0_servers(small_objects_ray, server_pool):
    """`server_pool.servers` for this test (its driver connected)."""
    return server_pool.servers


# ---- failures: driving OverlappedWeightSync directly ------------------------------------------


def run_sync(sync: OverlappedWeightSync, version: int):
    return asyncio.run(asyncio.wait_for(sync.sync(version, time.time()), TIMEOUT_S))


def announce(stream: BucketStream, buckets, refs):
    """Announce each bucket with its ref (one object) or list of refs (runs, as the sender puts them)."""
    async def put_all():
        for bucket, ref in zip(buckets, refs):
            runs = ref if isinstance(ref, list) else [ref]
            await stream.put_bucket(BucketRef(bucket.version, bucket.index, bucket.slices,
                                              {"store": StoredBucket(runs)}))

    return put_all()


def make_sync(servers, log, timeout_s=30.0):
    stream = BucketStream(max_in_flight=64)
    receivers = [ActorReceiver(f"server_{i}", s, True) for i, s in enumerate(servers)]
    return OverlappedWeightSync(receivers, log, stream, timeout_s=timeout_s), stream


def failing_sync(servers, log, prepare, timeout_s=30.0):
    """Announce version 1 with `prepare(buckets, refs, stream)` sabotaging it; return the error."""
    sync, stream = make_sync(servers, log, timeout_s)
    buckets = list(pack_buckets(tiny_model(1).state_dict().items(), 2048, version=1))
    refs = [ray.put(b.data) for b in buckets]

    async def main():
        await prepare(buckets, refs, stream)
        return await sync.sync(1, time.time())

    with pytest.raises(WeightSyncError) as info:
        asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    return str(info.value)


def assert_still_serving_version_0(servers, model_dir):
    original = {n: tensor_digest(t) for n, t in transformers.AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}
    for server in servers:
        assert ray.get(server.get_param_version.remote(), timeout=TIMEOUT_S) == 0
        assert digests_of(server) == original
        out = ray.get(server.generate.remote(prompt_ids=[1, 2], sampling_params={"max_tokens": 3}, request_id="after"),
                      timeout=TIMEOUT_S)
        assert out.extra_fields["token_versions"] == [0, 0, 0]


@ray.remote
def unfetchable_bucket():
    """A bucket reference whose fetch fails, as when the object store has lost the object."""
    raise ray.exceptions.ObjectLostError("bucket-3", "owner", "the object store lost it")


def test_lost_bucket_keeps_the_previous_version(version_0_servers, model_dir):
    servers = version_0_servers(2, dual=True)
    log = DriverLog()

    async def lose_one(buckets, refs, stream):
        refs[3] = unfetchable_bucket.remote()
        await announce(stream, buckets, refs)
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))

    message = failing_sync(servers, log, lose_one)
    assert "recv + register-buffer of version 1 failed on receiver 'server_" in message
    assert "ObjectLostError" in message
    assert_still_serving_version_0(servers, model_dir)
    assert log.get() == []


def test_bucket_that_never_arrives_fails_the_check(version_0_servers, model_dir):
    servers = version_0_servers(1, dual=False)
    log = DriverLog()

    async def skip_one(buckets, refs, stream):
        await announce(stream, buckets[:2] + buckets[3:], refs[:2] + refs[3:])
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))

    message = failing_sync(servers, log, skip_one)
    assert "check of version 1 failed on receiver 'server_0'" in message and "buckets [2]" in message
    assert_still_serving_version_0(servers, model_dir)


def test_silent_sender_times_out_and_failed_send_is_reported(version_0_servers, model_dir):
    servers = version_0_servers(1, dual=True)
    log = DriverLog()

    async def go_silent(buckets, refs, stream):
        await announce(stream, buckets[:1], refs[:1])

    assert "no bucket of version 1 arrived for 2 s" in failing_sync(servers, log, go_silent, timeout_s=2.0)

    async def fail_send(buckets, refs, stream):
        await announce(stream, buckets[:1], refs[:1])
        stream.fail(1, "RuntimeError: gather exploded")

    message = failing_sync(servers, log, fail_send)
    assert "the trainer's send of version 1 failed: RuntimeError: gather exploded" in message
    assert_still_serving_version_0(servers, model_dir)


def test_dead_receiver_is_named_and_the_others_keep_serving(version_0_servers, model_dir):
    servers = version_0_servers(2, dual=True)  # the pool replaces the one killed here when a later test needs it
    log = DriverLog()

    async def kill_midway(buckets, refs, stream):
        await announce(stream, buckets[:2], refs[:2])
        await asyncio.sleep(0.5)
        ray.kill(servers[1], no_restart=True)
        await announce(stream, buckets[2:], refs[2:])
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))

    message = failing_sync(servers, log, kill_midway)
    assert "receiver 'server_1'" in message and "ActorDiedError" in message
    assert_still_serving_version_0(servers[:1], model_dir)


# ---- a sync through Ray: the param_update stage, a trainer, servers generating meanwhile -------------


@pytest.mark.parametrize("dual,bucket_bytes", [(False, [1 << 20]), (True, [700, 32 * 16 * 4])],
                         ids=["copy", "dual_buffer_two_versions"])
def test_sync_through_ray_is_bit_identical_while_serving(version_0_servers, dual, bucket_bytes):
    """Two servers keep generating while each version arrives (version v in buckets of bucket_bytes[v - 1],
    the trainer stepping between versions); after each, both hold the trainer's bytes."""
    servers = version_0_servers(2, dual, keep=False)
    log = VersionLog.remote()
    stage = ray.remote(ParamUpdateStage).options(max_concurrency=64).remote(
        receivers=[ActorReceiver(f"server_{i}", s, True) for i, s in enumerate(servers)], clock=log
    )
    ray.get(stage.connect.remote([], 1), timeout=TIMEOUT_S)
    run = stage.run.remote()
    trainer = Trainer.remote(seed=1)
    for version, size in enumerate(bucket_bytes, start=1):
        requests = [
            s.generate.remote(prompt_ids=[1, 2, 3], sampling_params={"temperature": 1.0, "max_tokens": 8},
                              request_id=f"v{version}r{i}")
            for i, s in enumerate(servers * 4)
        ]
        ray.get(stage.put.remote(NewWeights(version=version, started_at=time.time())), timeout=TIMEOUT_S)
        want = ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)
        gather = ray.get(trainer.send.remote(version, size, stage), timeout=TIMEOUT_S)
        ray.get(trainer.step.remote(), timeout=TIMEOUT_S)  # the sent version must not change with it
        timings = wait_for_timings(stage, version)
        outputs = ray.get(requests, timeout=TIMEOUT_S)
        assert all(len(o.token_ids) == 8 for o in outputs)
        for server in servers:
            assert digests_of(server) == want
            assert ray.get(server.get_param_version.remote(), timeout=TIMEOUT_S) == version
        assert ray.get(log.get.remote(), timeout=TIMEOUT_S) == list(range(1, version + 1))
        parts = ("gather", "send", "recv", "register_buffer", "load", "total")
        assert all(timings[f"timing_s/param_update/{p}"] >= 0 for p in parts)
        assert timings["async/param_update/blocked_s"] <= timings["timing_s/param_update/load"]
        assert timings["async/param_update/num_buckets"] >= 1 and gather["gather_s"] >= 0
    ray.get(stage.put.remote(END_OF_STREAM), timeout=TIMEOUT_S)
    ray.get(run, timeout=TIMEOUT_S)


# ---- verl's replicas: the checkpoint-engine backend ------------------------------------


def test_verl_builds_the_staged_engine_from_the_pipeline_config(demo_dir):
    from verl.checkpoint_engine.base import CheckpointEngineRegistry
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides
    from helpers.lineage import compose_ppo
    from param_update.verl_engine import StagedCheckpointEngine, use_staged_checkpoint_engine

    config = compose_ppo(demo_overrides(demo_dir, extra={"actor_rollout_ref.rollout.name": "vllm"}))
    strip_async_keys(config)
    use_staged_checkpoint_engine(config, consume_bucket_mb=64, dual_buffer=False)
    section = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)  # verl's own dataclass
    import_external_libs(section.custom_backend_module)  # what CheckpointEngineWorker does first
    kwargs = section.engine_kwargs.get(section.backend, {})
    rollout_side = CheckpointEngineRegistry.new(section.backend, bucket_size=section.update_weights_bucket_megabytes << 20,
                                                **kwargs)
    assert isinstance(rollout_side, StagedCheckpointEngine)
    assert rollout_side.dual_buffer is False and rollout_side.bucket_size == 64 << 20
    # verl's actor worker builds one from the same section too: it must construct
    assert isinstance(CheckpointEngineRegistry.new(section.backend, is_master=True, bucket_size=1, **kwargs),
                      StagedCheckpointEngine)


@ray.remote
class FakeCheckpointEngineWorker:
    """What verl's CheckpointEngineWorker does with a checkpoint engine, minus the GPU server."""

    def __init__(self):
        from param_update.verl_engine import StagedCheckpointEngine

        self.engine = StagedCheckpointEngine(bucket_size=1 << 20)
        self.loaded = {}
        self.calls = []

    def execute_checkpoint_engine(self, method, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def update_weights(self, global_steps=None):  # verl: server_adapter.update_weights(receive_weights())
        self.calls.append(("update_weights", global_steps))
        self.loaded = {name: tensor_digest(t) for name, t in self.engine.receive_weights(global_steps)}

    def get(self):
        return self.loaded, self.calls


class FakeReplica:
    def __init__(self, workers, servers=("server",), dead_servers=()):
        self.workers = workers
        self.servers = list(servers)
        self._server_handle = self.servers[0]
        self.events = []
        self.dead_servers = set(dead_servers)  # a server's process is gone: calls to it raise

    @property
    def server_handle(self):
        return self._server_handle

    async def abort_all_requests(self, reject_request=False):
        if self.dead_servers & set(self.servers):
            raise ray.exceptions.ActorDiedError()
        self.events.append("abort")

    async def resume_generation(self):
        self.events.append("resume")


@pytest.mark.parametrize("dual", [True, False])
def test_verl_replica_receiver_stages_then_loads_through_verl_update_weights(small_objects_ray, dual):
    trained = tiny_model(1)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in trained.state_dict().items()}
    replica = FakeReplica([FakeCheckpointEngineWorker.remote() for _ in range(2)])
    receiver = VerlReplicaReceiver("rollout_replica_0", replica)
    log = DriverLog()
    stream = BucketStream(max_in_flight=64)
    sync = OverlappedWeightSync([receiver], log, stream, timeout_s=30)
    buckets = list(pack_buckets(trained.state_dict().items(), 3000, version=1))
    refs = [[ray.put(run) for run in split_arrays(b.data, 3)] for b in buckets]  # as the sender puts them
    assert max(len(r) for r in refs) > 1

    async def main():
        await receiver.configure(ReceiverSetup(dual, 0, layout))
        await announce(stream, buckets, refs)
        stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))
        return await sync.sync(1, time.time())

    timings = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    want = {n: tensor_digest(t) for n, t in trained.state_dict().items()}
    for worker in replica.workers:
        loaded, calls = ray.get(worker.get.remote(), timeout=TIMEOUT_S)
        assert loaded == want and calls == [("update_weights", 1)]
    assert replica.events == ["abort", "resume"]  # generation paused only around the load
    assert timings["async/param_update/blocked_s"] == timings["timing_s/param_update/load"]
    assert log.get() == [1]


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


@ray.remote
class GatedSink:
    """A param_update stand-in whose `put_bucket` waits until `open()`: buckets back up in the sender."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.buckets, self.ended = [], None

    def open_version(self, version, sender_node):
        return Route({"store": (ObjectStore, True)})  # no receiver on the sender's node: the object store

    async def put_bucket(self, version, index, handles, slices):
        await self.gate.wait()
        self.buckets.append((index, handles["store"], slices))

    def end_version(self, version, count, timings, at_end=(), whole=()):
        self.ended = (version, count, len(at_end))

    def open(self):
        self.gate.set()

    def get(self):
        return self.buckets, self.ended


def test_sent_version_is_unchanged_by_the_next_training_step(small_objects_ray):
    """Buckets still queued in the send thread when training resumes carry the gathered bytes."""
    from async_rl.api.weights import Bucket
    from param_update.buckets import tensors_from_buckets

    trainer, sink = Trainer.remote(seed=1), GatedSink.remote()
    want = ray.get(trainer.digests.remote(), timeout=TIMEOUT_S)
    state = tiny_model(1).state_dict()
    last = list(state.values())[-1]
    bucket_bytes = sum(t.nbytes for t in state.values()) - last.nbytes  # all but the last tensor, then it
    count = len(list(pack_buckets(state.items(), bucket_bytes, 1)))
    # the send thread queues 2 items: it holds bucket 0 at the gate, bucket 1 and the end mark wait
    assert count == 2, f"the test needs 2 buckets, got {count}"
    ray.get(trainer.send.remote(1, bucket_bytes, sink), timeout=TIMEOUT_S)
    ray.get(trainer.step.remote(), timeout=TIMEOUT_S)
    ray.get(sink.open.remote(), timeout=TIMEOUT_S)
    deadline = time.time() + TIMEOUT_S
    while ray.get(sink.get.remote(), timeout=TIMEOUT_S)[1] is None and time.time() < deadline:
        time.sleep(0.05)
    announced, ended = ray.get(sink.get.remote(), timeout=TIMEOUT_S)
    assert ended == (1, count, 0) and [i for i, _, _ in announced] == list(range(count))
    assert max(len(stored.refs) for _, stored, _ in announced) > 1, "a bucket travels as several objects"
    buckets = [Bucket(1, i, stored.read(slices), slices) for i, stored, slices in announced]
    assert {n: tensor_digest(t) for n, t in tensors_from_buckets(buckets)} == want
    assert ray.get(trainer.digests.remote(), timeout=TIMEOUT_S) != want  # the step did change the weights


# ---- a rollout server lost mid-sync, restarted (async_rl/rollout/supervisor.py) -------------------


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


@ray.remote
class EngineRank:
    """A process holding the `async_rl` checkpoint engine as verl's trainer ranks and
    CheckpointEngineWorkers do; `send` iterates the weights as verl's actor worker hands them over."""

    def __init__(self, **engine_kwargs):
        from param_update.verl_engine import StagedCheckpointEngine

        self.engine = StagedCheckpointEngine(**engine_kwargs)

    def execute_checkpoint_engine(self, method, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    async def send(self, seed, fail_after=None):
        def weights():
            for i, (name, tensor) in enumerate(tiny_model(seed).state_dict().items()):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("gather failed on this rank")
                yield name, tensor

        return await self.engine.send_weights(weights())

    async def receive(self):
        return {name: tensor_digest(t) async for name, t in self.engine.receive_weights()}


def connect(trainer_ranks, receivers):
    """What verl's CheckpointEngineManager.build_process_group does, for this backend."""
    from param_update.verl_engine import StagedCheckpointEngine

    ranks = trainer_ranks + receivers
    metadata = ray.get([r.execute_checkpoint_engine.remote("prepare") for r in ranks], timeout=TIMEOUT_S)
    actor_kwargs, rollout_kwargs = StagedCheckpointEngine.build_topology(len(trainer_ranks), len(receivers), metadata)
    ray.get([r.execute_checkpoint_engine.remote("init_process_group", **{k: v[i] for k, v in actor_kwargs.items()})
             for i, r in enumerate(trainer_ranks)]
            + [r.execute_checkpoint_engine.remote("init_process_group", **{k: v[i] for k, v in rollout_kwargs.items()})
               for i, r in enumerate(receivers)], timeout=TIMEOUT_S)


def test_the_async_rl_backend_sends_under_verls_checkpoint_engine_manager(small_objects_ray):
    """verl's manager (its fully_async_policy) with `checkpoint_engine.backend=async_rl`: trainer rank 0
    hands buckets to every receiver through the object store while the others only iterate their
    weights; both receivers get the trainer's weights bit for bit, twice (the handoff is reused)."""
    trainer_ranks = [EngineRank.remote(bucket_size=4096, is_master=rank == 0) for rank in range(2)]
    receivers = [EngineRank.remote(bucket_size=4096) for _ in range(2)]
    for seed in (1, 2):
        connect(trainer_ranks, receivers)
        received = ray.get([r.receive.remote() for r in receivers] + [t.send.remote(seed) for t in trainer_ranks],
                           timeout=TIMEOUT_S)
        want = {n: tensor_digest(t) for n, t in tiny_model(seed).state_dict().items()}
        assert received[0] == want and received[1] == want
        ray.get([r.execute_checkpoint_engine.remote("finalize") for r in trainer_ranks + receivers], timeout=TIMEOUT_S)
    assert len(want) > 3 and sum(t.numel() * 4 for t in tiny_model(1).state_dict().values()) > 4 * 4096  # buckets


def test_the_async_rl_backend_fails_the_receivers_when_the_send_fails_or_never_comes(small_objects_ray):
    """A send that fails midway fails the receivers naming its cause; the next update (verl calls no
    finalize after a failure) starts clean; a send that never comes fails them after the timeout."""
    trainer = EngineRank.remote(bucket_size=4096, is_master=True)
    receiver = EngineRank.remote(bucket_size=4096, handoff_timeout_s=2)
    connect([trainer], [receiver])
    failed = receiver.receive.remote()
    with pytest.raises(ray.exceptions.RayTaskError, match="gather failed on this rank"):
        ray.get(trainer.send.remote(1, fail_after=3), timeout=TIMEOUT_S)
    with pytest.raises(ray.exceptions.RayTaskError, match="the trainer's weight send failed: RuntimeError: gather failed"):
        ray.get(failed, timeout=TIMEOUT_S)
    connect([trainer], [receiver])
    received, _ = ray.get([receiver.receive.remote(), trainer.send.remote(2)], timeout=TIMEOUT_S)
    assert received == {n: tensor_digest(t) for n, t in tiny_model(2).state_dict().items()}
    connect([trainer], [receiver])
    with pytest.raises(ray.exceptions.RayTaskError, match="no weight bucket 0 from the trainer within 2 s"):
        ray.get(receiver.receive.remote(), timeout=TIMEOUT_S)  # no send at all


def test_a_staging_call_shows_its_recv_and_register_buffer_inside_it_and_a_load_its_interrupted():
    """The timeline's receiver track: the call's span, and its receiver-measured recv and register-buffer
    as the call's last seconds (so the five parts each have spans)."""

    class Receiver:
        name, replica_index = "server_0", None

        async def stage(self, bucket):
            await asyncio.sleep(0.05)
            return {"recv_s": 0.02, "register_s": 0.01}

        async def commit(self, version, num_buckets):
            return {"load_s": 0.0, "interrupted": 3}

    sync = OverlappedWeightSync([Receiver()], clock=None, stream=BucketStream(),
                                trace=TraceRecorder("weight sync", enabled=True))

    async def calls():
        await sync._on_all("recv + register-buffer", 1, lambda r: r.stage(None))
        await sync._on_all("load", 1, lambda r: r.commit(1, 1))

    asyncio.run(calls())
    spans = {name: (start, end, args) for _, name, start, end, args in sync.trace.pop()["events"]}
    call_start, call_end, _ = spans["recv + register-buffer"]
    recv_start, recv_end, _ = spans["recv"]
    register_start, register_end, _ = spans["register-buffer"]
    assert call_start <= recv_start and register_end == call_end  # inside the call, at its end
    assert recv_end == register_start
    assert recv_end - recv_start == pytest.approx(0.02) and register_end - register_start == pytest.approx(0.01)
    assert spans["load"][2] == {"version": 1, "interrupted": 3}
