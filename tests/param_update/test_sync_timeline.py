"""The sync's timeline (OverlappedWeightSync's trace): a receiver's staging call shows its receiver-measured
recv and register-buffer inside it, at its end, and a load shows the requests it interrupted."""

from __future__ import annotations

import asyncio

import pytest

from async_rl.core.trace import TraceRecorder
from param_update.sync import BucketStream, OverlappedWeightSync


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
