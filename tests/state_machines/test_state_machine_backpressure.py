"""Backpressure between StateMachine stages (state_machines/base.py): a stage's bounded inbox holds its
upstream back, so a source runs at most `inbox_size + 1` items ahead of a slow sink (and, with a big inbox,
the same measure sees it run far ahead); `put` waits while the inbox is full."""

import asyncio

import pytest

from state_machines.base import END_OF_STREAM
from toy_stages import HANG_S, Sink, Source, chain, run


@pytest.mark.parametrize("inbox_size", [1, 3])
def test_backpressure_bounds_how_far_the_source_runs_ahead(inbox_size):
    """While the slow sink has taken k items the source has emitted at most
    k + inbox_size + 1: inbox_size waiting in the inbox and one blocked in `put`."""
    n = 25
    src = Source(n)
    leads = []
    sink = Sink(delay=0.01, inbox_size=inbox_size, on_item=lambda k: leads.append(src.emitted - k))
    chain(src, sink)

    async def main():
        await asyncio.gather(src.run(), sink.run())

    run(main())
    assert sink.got == list(range(n))
    assert len(leads) == n
    assert max(leads) <= inbox_size + 1
    # the source does run ahead up to the inbox size (it is not lock-stepped with the sink)
    assert max(leads) >= inbox_size


def test_without_backpressure_the_source_runs_ahead():
    """Control for the test above: a big inbox lets the source run far ahead of the slow sink (at least
    half the stream, where backpressure holds it within inbox_size + 1), so the lead measure is able to see
    a runaway source."""
    n = 25
    src = Source(n)
    leads = []
    sink = Sink(delay=0.05, inbox_size=1000, on_item=lambda k: leads.append(src.emitted - k))
    chain(src, sink)

    async def main():
        await asyncio.gather(src.run(), sink.run())

    run(main())
    assert max(leads) >= n // 2


def test_put_waits_while_inbox_full():
    sink = Sink(inbox_size=2)
    sink.connect([], 1)

    async def main():
        await sink.put(0)
        await sink.put(1)
        blocked = asyncio.ensure_future(sink.put(2))
        await asyncio.sleep(0.05)
        assert not blocked.done()
        run_task = asyncio.ensure_future(sink.run())  # starts taking items
        await asyncio.wait_for(blocked, HANG_S)
        await sink.put(END_OF_STREAM)
        return await asyncio.wait_for(run_task, HANG_S)

    stats = run(main())
    assert sink.got == [0, 1, 2] and stats["items"] == 3
