"""How a StateMachine stage ends (state_machines/base.py): `drain()` takes no new input, finishes the items in
flight, sends END_OF_STREAM and ends, also when it is idle on an empty inbox; `stop()` cancels the items in
flight and ends at once without an end mark, before or during `run()`, which returns its stats; a
cancellation from outside, without `stop()`, still raises."""

import asyncio

import pytest

from state_machines.base import END_OF_STREAM
from toy_stages import HANG_S, Mapper, Recorder, Sink, Source, chain, feed, run


class DrainingMapper(Mapper):
    """Calls drain() on itself when item `drain_at` starts, then keeps working on it."""

    def __init__(self, drain_at, **kw):
        super().__init__(**kw)
        self.drain_at = drain_at
        self.inflight_at_drain = None

    async def process_data(self, data):
        if data == self.drain_at:
            self.drain()
            self.inflight_at_drain = sorted(set(self.started) - set(self.finished) | {data})
        return await super().process_data(data)


def test_drain_finishes_inflight_items_and_sends_end():
    src = Source(None)  # never ends on its own
    delays = {3: 0.06, 4: 0.04}  # items 3 and 4 are still in flight when 5 starts
    mapper = DrainingMapper(
        5, fn=lambda x: x + 100, delay=lambda x: delays.get(x, 0.01), max_inflight=3, inbox_size=2
    )
    out = Recorder()
    chain(src, mapper)
    mapper.connect([out], 1)

    async def main():
        src_task = asyncio.ensure_future(src.run())
        stats = await asyncio.wait_for(mapper.run(), HANG_S)
        src.stop()
        await asyncio.wait_for(src_task, HANG_S)
        return stats

    stats = run(main())
    assert mapper.inflight_at_drain == [3, 4, 5]
    assert out.items[-1] is END_OF_STREAM
    assert out.items.count(END_OF_STREAM) == 1
    sent = out.items[:-1]
    # every item that started was finished (not cancelled) and sent, in order
    assert mapper.cancelled == []
    assert sorted(mapper.started) == sorted(mapper.finished)
    assert sent == [x + 100 for x in range(len(mapper.started))]
    assert 6 <= len(sent) <= 7  # at most the one item already being fetched is taken after drain
    assert stats["name"] == "mapper" and stats["items"] == len(sent)
    # it stopped taking input: the source kept producing but the mapper did not take it
    assert src.emitted > len(mapper.started)


def test_drain_source_ends_stream_downstream():
    src = Source(None, delay=0.002)
    sink = Sink()
    chain(src, sink)

    async def main():
        src_task = asyncio.ensure_future(src.run())
        sink_task = asyncio.ensure_future(sink.run())
        while len(sink.got) < 5:
            await asyncio.sleep(0.005)
        src.drain()
        return await asyncio.wait_for(asyncio.gather(src_task, sink_task), HANG_S)

    s_src, s_sink = run(main())
    assert sink.got == list(range(len(sink.got)))
    assert s_src["items"] == s_sink["items"] == len(sink.got) == src.emitted


def test_drain_while_waiting_for_input_ends_without_new_input():
    """drain() promises 'take no new input; finish the items in flight, then end'.
    A stage idle on an empty inbox must end: it holds nothing."""
    mapper = Mapper()
    out = Recorder()
    mapper.connect([out], 1)

    async def main():
        task = asyncio.ensure_future(mapper.run())
        await asyncio.sleep(0.05)  # now waiting in get_input_data
        mapper.drain()
        try:
            done, _ = await asyncio.wait({task}, timeout=2)
            ended_without_input = task in done
            if not ended_without_input:
                await mapper.put(7)  # a late item must not be taken after drain()
                await asyncio.wait_for(task, HANG_S)
            return ended_without_input
        finally:
            task.cancel()

    ended_without_input = run(main())
    assert mapper.started == [], "drained stage took new input"
    assert ended_without_input, "drained stage idle on its inbox never ended"
    assert out.items == [END_OF_STREAM]


def test_stop_cancels_inflight_and_sends_no_end():
    mapper = Mapper(delay=lambda x: 60.0, max_inflight=2)
    out = Recorder()
    mapper.connect([out], 1)

    async def main():
        task = asyncio.ensure_future(mapper.run())
        await feed(mapper, [1, 2], end=False)
        while len(mapper.started) < 2:
            await asyncio.sleep(0.005)
        mapper.stop()
        # run() swallows the cancellation it caused and returns its stats
        stats = await asyncio.wait_for(task, HANG_S)
        await asyncio.sleep(0)  # let the cancelled process_data tasks unwind
        return stats

    stats = run(main())
    assert isinstance(stats, dict) and stats["name"] == "mapper" and stats["items"] == 0
    assert out.items == []
    assert sorted(mapper.cancelled) == [1, 2] and mapper.finished == []


def test_stop_while_idle_returns_stats_without_end():
    sink = Sink()
    out = Recorder()
    sink.connect([out], 1)

    async def main():
        task = asyncio.ensure_future(sink.run())
        await asyncio.sleep(0.02)
        sink.stop()
        return await asyncio.wait_for(task, HANG_S)

    stats = run(main())
    assert stats["name"] == "sink" and out.items == []


def test_stop_before_run_ends_at_once_without_end():
    src = Source(None)
    out = Recorder()
    src.connect([out], 0)
    src.stop()
    stats = run(src.run())
    assert stats["items"] == 0 and out.items == [] and src.emitted == 0


def test_external_cancel_without_stop_propagates():
    """Only stop() makes run() swallow cancellation; an outside cancel still raises."""
    sink = Sink()
    sink.connect([], 1)

    async def main():
        task = asyncio.ensure_future(sink.run())
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
