"""What the weight-sync tests of test_sync_*.py share: CPU rollout servers of a tiny model (`start_server`), a
pool of them serving version 0 that the tests of one module share (`ServerPool`; the fixtures `model_dir`,
`server_pool` and `version_0_servers`, which a test module imports to use), a stand-in for the version log
(`DriverLog`), announcing buckets to a `BucketStream` (`announce`), and fakes of verl's replica and its
CheckpointEngineWorker."""

from __future__ import annotations

import sys
import uuid
from types import SimpleNamespace

import pytest
import ray
import transformers

from async_rl.api.weights import BucketRef
from async_rl.rollout.cpu.server import CPURolloutServer
from param_update.buckets import tensor_digest
from param_update.sync import BucketStream
from param_update.transports.object_store import StoredBucket
from sync_actors import tiny_model
from helpers.clusters import RAY_CALL_GUARD_S


# FakeCheckpointEngineWorker lives in this module: Ray pickles it by value, as sync_actors.py's actors
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT_S = RAY_CALL_GUARD_S  # a hang guard, not a bound on how long a call takes


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


def announce(stream: BucketStream, buckets, refs):
    """Announce each bucket with its ref (one object) or list of refs (runs, as the sender puts them)."""
    async def put_all():
        for bucket, ref in zip(buckets, refs):
            runs = ref if isinstance(ref, list) else [ref]
            await stream.put_bucket(BucketRef(bucket.version, bucket.index, bucket.slices,
                                              {"store": StoredBucket(runs)}))

    return put_all()


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
