"""The weight-holder contract (async_rl/api/weights.py `WeightHolder`) proven by extension: a holder
written here is its layout and one method, its load (`load_staged`); the holder base
(param_update/holder.py) gives it every call the sync makes, and a version reaches it bit for bit
through the param_update stage's sync."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import ray

from async_rl.api.weights import BucketRef
from param_update.buckets import pack_buckets, tensor_digest
from param_update.holder import StagedWeights
from param_update.receivers import ActorReceiver
from param_update.staging import StagingError, weight_layout
from param_update.sync import BucketStream, OverlappedWeightSync, VersionEnd
from param_update.transports.object_store import StoredBucket
from sync_actors import VersionLog, tiny_model
from helpers.clusters import RAY_CALL_GUARD_S

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
TIMEOUT_S = RAY_CALL_GUARD_S  # a hang guard, not a bound on how long a call takes


class DigestHolder(StagedWeights):
    """Holds a version as the digests of its tensors."""

    def __init__(self, seed: int):
        expected, aliases, _ = weight_layout(tiny_model(seed).state_dict())  # tied lm_head: an alias
        self.start_staging(expected, aliases)
        self.served = (0, {})

    def load_staged(self, version, staged):  # the one method a holder writes
        self.served = (version, {name: tensor_digest(t) for name, t in staged.named_tensors()})
        staged.reset()
        return {"load_s": 0.0, "blocked_s": 0.0, "keeps_buffer": False}

    def get(self):
        return self.served


def test_a_holder_is_its_load_and_gets_a_version_through_the_sync(small_objects_ray):
    model = tiny_model(1)
    holder = ray.remote(DigestHolder).remote(0)
    stream = BucketStream(max_in_flight=4)
    sync = OverlappedWeightSync([ActorReceiver("holder", holder, serves_generation=True)], VersionLog.remote(),
                                stream, timeout_s=60.0)
    buckets = list(pack_buckets(model.state_dict().items(), 2048, version=1))

    async def main():
        async def send():
            for b in buckets:
                await stream.put_bucket(BucketRef(1, b.index, b.slices, {"store": StoredBucket([ray.put(b.data)])}))
            stream.end_version(VersionEnd(1, len(buckets), {"gather": 0.0, "send": 0.0}))

        sending = asyncio.ensure_future(send())
        timings = await sync.sync(1, time.time())
        await sending
        return timings

    timings = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert len(buckets) > 4 and timings["async/param_update/store_receivers"] == 1.0
    want = {name: tensor_digest(t) for name, t in model.state_dict().items() if name != "lm_head.weight"}  # tied
    assert ray.get(holder.get.remote(), timeout=TIMEOUT_S) == (1, want)
    with pytest.raises(StagingError, match="version 2 was never staged"):  # the base's check guards the load
        ray.get(holder.commit_weights.remote(2, len(buckets)), timeout=TIMEOUT_S)
