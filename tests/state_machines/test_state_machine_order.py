"""The StateMachine base (state_machines/base.py) moves items in order: a chain of local stages delivers every
item in input order and ends once; with `max_inflight` items overlap up to the limit and still leave in
order; bad sizes are refused naming the stage; a stage fed by several upstreams ends after the last one ends
(one END_OF_STREAM downstream), and a stage with several downstreams sends each of them every item and the
end."""

import asyncio
import random

import pytest

from state_machines.base import END_OF_STREAM
from toy_stages import HANG_S, Mapper, Recorder, Sink, Source, chain, feed, run


def test_three_stage_chain_preserves_order_and_ends():
    n = 50
    src, mapper, sink = Source(n), Mapper(fn=lambda x: 10 * x), Sink()
    chain(src, mapper, sink)

    async def main():
        return await asyncio.gather(src.run(), mapper.run(), sink.run())

    s_src, s_map, s_sink = run(main())
    assert sink.got == [10 * i for i in range(n)]
    assert (s_src["name"], s_map["name"], s_sink["name"]) == ("source", "mapper", "sink")
    assert s_src["items"] == s_map["items"] == s_sink["items"] == n


def test_max_inflight_keeps_input_order_with_random_delays():
    n = 40
    rng = random.Random(1234)
    delays = [rng.uniform(0.0, 0.03) for _ in range(n)]
    src = Source(n)
    mapper = Mapper(fn=lambda x: (x, x * x), delay=lambda x: delays[x], max_inflight=4, inbox_size=4)
    sink = Sink(inbox_size=n)
    chain(src, mapper, sink)

    async def main():
        await asyncio.gather(src.run(), mapper.run(), sink.run())

    run(main())
    assert sink.got == [(i, i * i) for i in range(n)]
    # the delays really overlapped (items finished out of order), within the limit
    assert mapper.finished != sorted(mapper.finished)
    assert 2 <= mapper.max_active <= 4


def test_max_inflight_one_processes_one_at_a_time():
    n = 10
    src, mapper, sink = Source(n), Mapper(delay=lambda x: 0.005), Sink()
    chain(src, mapper, sink)

    async def main():
        await asyncio.gather(src.run(), mapper.run(), sink.run())

    run(main())
    assert mapper.max_active == 1
    assert sink.got == list(range(n))


def test_bad_sizes_rejected():
    with pytest.raises(ValueError, match="'x'"):
        Sink(name="x", inbox_size=0)
    with pytest.raises(ValueError, match="'y'"):
        Sink(name="y", max_inflight=0)


def test_fan_in_ends_only_after_every_upstream_ended():
    sink = Sink(inbox_size=10)
    out = Recorder()
    sink.connect([out], 2)

    async def main():
        task = asyncio.ensure_future(sink.run())
        await feed(sink, ["a0", "a1"])  # upstream A ends
        await asyncio.sleep(0.05)
        assert not task.done(), "ended after one of two upstreams"
        await feed(sink, ["b0"])  # upstream B ends
        return await asyncio.wait_for(task, HANG_S)

    stats = run(main())
    assert sink.got == ["a0", "a1", "b0"] and stats["items"] == 3
    assert out.items == [END_OF_STREAM]  # one END downstream, not one per upstream


def test_fan_in_two_sources_into_one_stage():
    a, b = Source(5, name="a"), Source(7, name="b", delay=0.003)
    merge = Mapper(name="merge")
    sink = Sink(inbox_size=20)
    a.connect([merge], 0)
    b.connect([merge], 0)
    merge.connect([sink], 2)
    sink.connect([], 1)

    async def main():
        await asyncio.gather(a.run(), b.run(), merge.run(), sink.run())

    run(main())
    assert sorted(sink.got) == sorted(list(range(5)) + list(range(7)))
    assert sink.got[-1] == 6  # the slower source's last item is the last one out


def test_fan_out_sends_each_item_and_end_to_every_downstream():
    src = Source(6)
    left, right = Sink(name="l"), Sink(name="r")
    src.connect([left, right], 0)
    left.connect([], 1)
    right.connect([], 1)

    async def main():
        await asyncio.gather(src.run(), left.run(), right.run())

    run(main())
    assert left.got == right.got == list(range(6))
