"""The trainer's side of the sync: the send thread hands over the bytes it gathered, so buckets still queued
when training resumes carry the sent version, not the next step's weights."""

from __future__ import annotations

import asyncio
import sys
import time

import ray

from async_rl.api.weights import Route
from param_update.buckets import pack_buckets, tensor_digest
from param_update.transports.object_store import ObjectStore
from sync_actors import Trainer, tiny_model
from sync_common import TIMEOUT_S


# GatedSink lives in this file: Ray pickles it by value, whatever name pytest imported it under
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
