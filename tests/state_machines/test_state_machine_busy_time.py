"""A StateMachine stage's busy time (state_machines/base.py, BusyTimer): the time it spends processing,
items that overlap counted once, a wait on another stage inside `process_data` (`paused()`) counted as
idle while no other item works; never more than the wall time."""

import asyncio

from state_machines.base import BusyTimer
from toy_stages import Mapper, Recorder, feed, run


def test_busy_time_counts_processing():
    mapper = Mapper(delay=lambda x: 0.05)
    mapper.connect([Recorder()], 1)

    async def run_it():
        feeder = asyncio.ensure_future(feed(mapper, range(10)))
        stats = await mapper.run()
        await feeder
        return stats

    stats = run(run_it())
    assert stats["items"] == 10
    assert stats["busy_s"] >= 0.4
    assert stats["busy_s"] <= stats["wall_s"]


def test_busy_time_counts_overlap_once():
    """Concurrent items count once: busy time is the union of busy intervals."""

    async def overlap():
        timer = BusyTimer()
        timer.start()

        async def item():
            timer.enter()
            try:
                await asyncio.sleep(0.05)
            finally:
                timer.leave()

        await asyncio.gather(*(item() for _ in range(10)))
        return timer

    timer = run(overlap())
    # 10 x 0.05 s of overlapping work: the union is at least one sleep and at most the
    # wall time; a sum would be >= 0.5 s and could not be <= wall time
    assert 0.05 <= timer.busy_s() <= timer.wall_s()
    assert timer._active == 0


def test_waiting_inside_process_data_is_idle_time(monkeypatch):
    """`waiting()` takes a wait on another stage out of busy time, only while no other item works."""
    now = [0.0]
    monkeypatch.setattr("state_machines.base.time.perf_counter", lambda: now[0])
    timer = BusyTimer()
    timer.start()
    timer.enter()  # item A: 1 s of work, 5 s waiting, 2 s of work
    now[0] += 1.0
    with timer.paused():
        now[0] += 5.0
    now[0] += 2.0
    timer.leave()
    assert timer.busy_s() == 3.0 and timer.wall_s() == 8.0
    timer.enter()  # item A waits while item B works: B's time stays busy
    timer.enter()
    with timer.paused():
        now[0] += 4.0
    timer.leave()
    timer.leave()
    assert timer.busy_s() == 7.0 and timer._active == 0


def test_busy_timer_before_start():
    timer = BusyTimer()
    assert timer.wall_s() == 0.0 and timer.busy_s() == 0.0
