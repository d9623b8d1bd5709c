"""The weight sync through Ray into CPU rollout servers (trainer send thread -> object store ->
param_update -> servers, real Ray actors): a version arrives bit-identical in two servers that keep generating
meanwhile, through the param_update stage and a trainer actor. A failed sync, driving OverlappedWeightSync
directly (a lost bucket, a bucket that never comes, a silent or failed send, a receiver that dies), names
its cause and leaves the previous version serving. The tests share their servers (`ServerPool`, this
module's: each test gets them serving version 0, asserted)."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray
import transformers

from async_rl.core.errors import WeightSyncError
from async_rl.core.messages import NewWeights
from param_update.buckets import pack_buckets, tensor_digest
from param_update.receivers import ActorReceiver
from param_update.sync import BucketStream, OverlappedWeightSync, VersionEnd
from state_machines.base import END_OF_STREAM
from state_machines.param_update import ParamUpdateStage
from sync_actors import Trainer, VersionLog, tiny_model, wait_for_timings
from sync_common import TIMEOUT_S, DriverLog, announce, digests_of
from sync_common import model_dir, server_pool, version_0_servers  # noqa: F401 - fixtures of this module's tests


# unfetchable_bucket lives in this file: Ray pickles it by value, whatever name pytest imported it under
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
