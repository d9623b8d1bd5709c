"""The sync into verl's replicas through the `async_rl` checkpoint-engine backend: verl builds it from the
pipeline's config; `VerlReplicaReceiver` stages the buckets and loads them through verl's `update_weights`
(fakes of verl's replica and CheckpointEngineWorker), generation paused only around the load; under verl's
own manager (its send side, as verl's fully_async_policy uses it) the receivers get bit-identical weights,
and a failed or missing send fails them naming its cause."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray

from async_rl.api.weights import ReceiverSetup
from async_rl.core.errors import WeightSyncError
from param_update.buckets import pack_buckets, tensor_digest
from param_update.receivers import VerlReplicaReceiver
from param_update.sync import BucketStream, OverlappedWeightSync, VersionEnd
from param_update.transports.object_store import split_arrays
from sync_actors import tiny_model
from sync_common import TIMEOUT_S, DriverLog, FakeCheckpointEngineWorker, FakeReplica, announce


# EngineRank lives in this file: Ray pickles it by value, whatever name pytest imported it under
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


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


@pytest.mark.parametrize("keeps_base", [True, False])
def test_verl_replicas_load_deltas_over_the_version_update_weights_read(small_objects_ray, keeps_base):
    """With deltas on (`ReceiverSetup(delta=True)`), each replica's engine keeps the version verl's update_weights
    read as the next delta's base: versions 2 and 3 go as deltas and every worker loads the trainer's bytes, as a
    full sync gives them. Without it the engine holds no base, and the first delta fails naming why."""
    import torch

    from param_update.delta import DeltaEncoder

    model = tiny_model(1)
    layout = {n: (t.dtype, tuple(t.shape)) for n, t in model.state_dict().items()}
    replica = FakeReplica([FakeCheckpointEngineWorker.remote() for _ in range(2)])
    receiver = VerlReplicaReceiver("rollout_replica_0", replica)
    stream = BucketStream(max_in_flight=64)
    sync = OverlappedWeightSync([receiver], DriverLog(), stream, timeout_s=30)
    encoder = DeltaEncoder()

    async def send(version):
        wire = list(encoder.encode(model.state_dict().items(), version, encoder.version))
        buckets = list(pack_buckets(wire, 3000, version=version))
        await announce(stream, buckets, [[ray.put(run) for run in split_arrays(b.data, 2)] for b in buckets])
        stream.end_version(VersionEnd(version, len(buckets), {"gather": 0.0, "send": 0.0}))
        return await sync.sync(version, time.time())

    async def main():
        await receiver.configure(ReceiverSetup(False, 0, layout, delta=keeps_base))
        sent = [await send(1)]
        for version in (2, 3):
            with torch.no_grad():  # a step that moves 2 % of the values
                for i, param in enumerate(model.parameters()):
                    moved = torch.rand(param.shape, generator=torch.Generator().manual_seed(version * 100 + i)) < 0.02
                    param.add_(moved * 0.05)
            sent.append(await send(version))
            want = {n: tensor_digest(t) for n, t in model.state_dict().items()}
            for worker in replica.workers:
                loaded, calls = ray.get(worker.get.remote(), timeout=TIMEOUT_S)
                assert loaded == want and calls[-1] == ("update_weights", version)
        return sent

    if not keeps_base:
        no_base = "version 2: a delta from version 1 arrived, the receiver holds version None"
        with pytest.raises(WeightSyncError, match=no_base):
            asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
        return
    sent = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert [t["async/param_update/delta"] for t in sent] == [0.0, 1.0, 1.0]
    assert max(t["async/param_update/bytes"] for t in sent[1:]) < 0.5 * sent[0]["async/param_update/bytes"]


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
