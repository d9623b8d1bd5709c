"""Tests for the abstract async StateMachine (state_machines/base.py).

Local stages are wired to each other directly (`put` is a coroutine on the stage); the
last test wires two stages as Ray async actors. Timeouts here only catch hangs: every
`asyncio.wait_for` limit is far above what the step needs.
"""

import asyncio
import random
import time

import pytest
import ray

from helpers.clusters import RAY_CALL_GUARD_S
from state_machines.base import END_OF_STREAM, BusyTimer, StageError, StateMachine

HANG_S = 10  # generous limit that only a hang reaches


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


# ---- test stages ------------------------------------------------------------------


class Source(StateMachine):
    """Emits 0..n-1 (forever when n is None), then END_OF_STREAM."""

    def __init__(self, n, name="source", delay=0.0, **kw):
        super().__init__(name, **kw)
        self.n = n
        self.delay = delay
        self.emitted = 0  # items returned by get_input_data

    async def get_input_data(self):
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.n is not None and self.emitted >= self.n:
            return END_OF_STREAM
        self.emitted += 1
        return self.emitted - 1

    async def process_data(self, data):
        return data

    async def send_output_data(self, data):
        return await self.send_downstream(data)


class Mapper(StateMachine):
    """Applies `fn` after sleeping `delay(item)` seconds; records concurrency and cancellations.
    It writes only `process_data`: the base class's inbox and downstream defaults do the rest."""

    def __init__(self, name="mapper", fn=lambda x: x, delay=lambda x: 0.0, **kw):
        super().__init__(name, **kw)
        self.fn = fn
        self.delay = delay
        self.active = 0
        self.max_active = 0
        self.started = []
        self.finished = []
        self.cancelled = []

    async def process_data(self, data):
        self.started.append(data)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.delay(data))
            out = self.fn(data)
        except asyncio.CancelledError:
            self.cancelled.append(data)
            raise
        finally:
            self.active -= 1
        self.finished.append(data)
        return out


class Sink(StateMachine):
    """Collects items; `on_item(k)` is called when the k-th item is taken (1-based)."""

    def __init__(self, name="sink", delay=0.0, on_item=None, **kw):
        super().__init__(name, **kw)
        self.delay = delay
        self.on_item = on_item
        self.got = []

    async def get_input_data(self):
        item = await self.next_from_inbox()
        if item is not END_OF_STREAM and self.on_item is not None:
            self.on_item(len(self.got) + 1)
        return item

    async def process_data(self, data):
        if self.delay:
            await asyncio.sleep(self.delay)
        self.got.append(data)
        return None

    async def send_output_data(self, data):
        raise AssertionError("a sink has no output")


class Recorder:
    """A local downstream object: anything with an async `put`."""

    def __init__(self):
        self.items = []

    async def put(self, item):
        self.items.append(item)


def chain(*stages):
    """Wire stages in a line; the first has no upstream."""
    for i, stage in enumerate(stages):
        nxt = [stages[i + 1]] if i + 1 < len(stages) else []
        stage.connect(nxt, 0 if i == 0 else 1)


async def feed(stage, items, end=True):
    for item in items:
        await stage.put(item)
    if end:
        await stage.put(END_OF_STREAM)


# ---- ordering -----------------------------------------------------------------------


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


# ---- backpressure -------------------------------------------------------------------


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


# ---- drain / stop -----------------------------------------------------------------


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


# ---- errors --------------------------------------------------------------------------


def test_process_data_error_raises_stage_error():
    def fn(x):
        if x == 3:
            raise ValueError("boom")
        return x

    mapper = Mapper(name="square-it", fn=fn)
    out = Recorder()
    mapper.connect([out], 1)

    async def main():
        feeder = asyncio.ensure_future(feed(mapper, range(10)))
        try:
            await mapper.run()
        finally:
            feeder.cancel()

    with pytest.raises(StageError) as info:
        run(main())
    msg = str(info.value)
    assert "square-it" in msg and "ValueError: boom" in msg and "process_data" in msg
    assert info.value.stage == "square-it" and info.value.original_type == "ValueError"
    assert isinstance(info.value.__cause__, ValueError)
    assert out.items == [0, 1, 2]  # outputs before the failure went out, no END_OF_STREAM


def test_process_data_error_with_inflight_names_process_data():
    """With max_inflight > 1 an item can fail while the loop waits for the next input;
    the message must still say the failure was in process_data."""

    def fn(x):
        raise ValueError("boom")

    mapper = Mapper(name="m4", fn=fn, delay=lambda x: 0.01, max_inflight=4)
    mapper.connect([Recorder()], 1)

    async def main():
        await mapper.put(0)  # then nothing more: the loop is waiting in get_input_data
        await mapper.run()

    with pytest.raises(StageError) as info:
        run(main())
    msg = str(info.value)
    assert "'m4'" in msg and "ValueError: boom" in msg
    assert "failed in process_data" in msg, msg.splitlines()[0]


def test_process_data_error_cancels_other_inflight_items():
    def fn(x):
        if x == 0:
            raise ValueError("boom")
        return x

    mapper = Mapper(name="m", fn=fn, delay=lambda x: 0.01 if x == 0 else 60.0, max_inflight=3)
    mapper.connect([Recorder()], 1)

    async def main():
        await feed(mapper, [0, 1], end=False)
        try:
            await mapper.run()
        finally:
            await asyncio.sleep(0.01)  # let cancellations land

    with pytest.raises(StageError, match="ValueError: boom"):
        run(main())
    assert mapper.cancelled == [1]


class FailingInput(Sink):
    async def get_input_data(self):
        raise KeyError("no input")


class FailingOutput(Mapper):
    async def send_output_data(self, data):
        raise ConnectionError(f"cannot send {data}")


class FailingStart(Sink):
    async def on_start(self):
        raise RuntimeError("no start")


def test_get_input_data_error_raises_stage_error():
    stage = FailingInput(name="reader")
    stage.connect([], 1)
    with pytest.raises(StageError) as info:
        run(stage.run())
    msg = str(info.value)
    assert "'reader'" in msg and "get_input_data" in msg and "KeyError: 'no input'" in msg


def test_send_output_data_error_raises_stage_error():
    stage = FailingOutput(name="writer")
    stage.connect([Recorder()], 1)

    async def main():
        await stage.put(5)
        await stage.run()

    with pytest.raises(StageError) as info:
        run(main())
    msg = str(info.value)
    assert "'writer'" in msg and "send_output_data" in msg and "ConnectionError: cannot send 5" in msg
    assert stage.finished == [5]


def test_on_start_error_raises_stage_error():
    stage = FailingStart(name="starter")
    stage.connect([], 1)
    with pytest.raises(StageError, match="'starter' failed in on_start: RuntimeError: no start"):
        run(stage.run())


def test_downstream_put_error_raises_stage_error():
    class BrokenDownstream:
        async def put(self, item):
            raise OSError("pipe closed")

    src = Source(3, name="src")
    src.connect([BrokenDownstream()], 0)
    with pytest.raises(StageError) as info:
        run(src.run())
    assert "'src'" in str(info.value) and "OSError: pipe closed" in str(info.value)


# ---- fan-in / fan-out --------------------------------------------------------------


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


def test_stage_error_survives_pickling():
    """Ray pickles an actor's exception to hand it to the driver."""
    import pickle

    import cloudpickle

    try:
        raise ValueError("boom")
    except ValueError as exc:
        err = StageError("reward", exc, "process_data")
    for lib in (pickle, cloudpickle):
        back = lib.loads(lib.dumps(err))
        assert type(back) is StageError
        assert (back.stage, back.original_type, str(back)) == ("reward", "ValueError", str(err))
    assert str(err).startswith("stage 'reward' failed in process_data: ValueError: boom\n")


def test_end_of_stream_is_a_singleton_across_pickling():
    import pickle

    import cloudpickle

    assert pickle.loads(pickle.dumps(END_OF_STREAM)) is END_OF_STREAM
    assert cloudpickle.loads(cloudpickle.dumps(END_OF_STREAM)) is END_OF_STREAM
    assert repr(END_OF_STREAM) == "END_OF_STREAM"


# ---- busy timing --------------------------------------------------------------------


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


# ---- Ray ----------------------------------------------------------------------------


def _ray_stage_classes():
    """Defined in a function so Ray pickles them by value (tests/ is not importable)."""

    class RaySource(StateMachine):
        def __init__(self, name, n):
            super().__init__(name)
            self.n = n
            self.i = 0

        async def get_input_data(self):
            if self.i >= self.n:
                return END_OF_STREAM
            self.i += 1
            return self.i - 1

        async def process_data(self, data):
            return data

        async def send_output_data(self, data):
            return await self.send_downstream(data)

    class RaySink(StateMachine):
        def __init__(self, name, fail_on=None):
            super().__init__(name, inbox_size=1)
            self.fail_on = fail_on
            self.got = []

        async def get_input_data(self):
            return await self.next_from_inbox()

        async def process_data(self, data):
            await asyncio.sleep(0.001)
            if data == self.fail_on:
                raise ValueError(f"bad item {data}")
            self.got.append(data * 2)
            return None

        async def send_output_data(self, data):
            return True

        def items(self):
            return self.got

    return RaySource, RaySink


def test_ray_actors_end_to_end(ray_cluster):
    RaySource, RaySink = _ray_stage_classes()
    src = ray.remote(num_cpus=0)(RaySource).remote("ray-src", 20)
    sink = ray.remote(num_cpus=0)(RaySink).remote("ray-sink")
    ray.get([src.connect.remote([sink], 0), sink.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    sink_ref = sink.run.remote()
    src_ref = src.run.remote()
    s_src, s_sink = ray.get([src_ref, sink_ref], timeout=RAY_CALL_GUARD_S)
    assert s_src["name"] == "ray-src" and s_src["items"] == 20
    assert s_sink["name"] == "ray-sink" and s_sink["items"] == 20
    assert ray.get(sink.items.remote(), timeout=RAY_CALL_GUARD_S) == [2 * i for i in range(20)]


def test_ray_stage_error_surfaces_with_stage_name(ray_cluster):
    RaySource, RaySink = _ray_stage_classes()
    src = ray.remote(num_cpus=0)(RaySource).remote("ray-src2", 20)
    sink = ray.remote(num_cpus=0)(RaySink).remote("ray-failing-sink", fail_on=4)
    ray.get([src.connect.remote([sink], 0), sink.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    sink_ref = sink.run.remote()
    src.run.remote()  # blocks on the dead stage's full inbox; killed below
    with pytest.raises(Exception) as info:
        ray.get(sink_ref, timeout=RAY_CALL_GUARD_S)
    assert not isinstance(info.value, ray.exceptions.GetTimeoutError)
    assert isinstance(info.value, ray.exceptions.RayTaskError)
    assert isinstance(info.value, StageError)  # RayTaskError keeps the cause's type
    cause = info.value.cause  # what the pipeline driver reports
    assert isinstance(cause, StageError) and cause.stage == "ray-failing-sink"
    assert str(cause).startswith("stage 'ray-failing-sink' failed in process_data: ValueError: bad item 4")
    assert "ray-failing-sink" in str(info.value) and "ValueError: bad item 4" in str(info.value)
    assert ray.get(sink.items.remote(), timeout=RAY_CALL_GUARD_S) == [0, 2, 4, 6]
    ray.kill(src)
    ray.kill(sink)


def test_a_dead_stage_is_named_not_the_neighbour_that_could_not_reach_it(ray_cluster):
    """SIGKILL-like death of a sink (ray.kill): the source's send fails first, with the sink's
    ActorDiedError inside its StageError; the driver names the sink, whose own `run` died."""
    from async_rl.loop import blame_stage

    RaySource, RaySink = _ray_stage_classes()
    src = ray.remote(num_cpus=0)(RaySource).remote("ray-src3", 10**6)
    sink = ray.remote(num_cpus=0)(RaySink).remote("ray-dying-sink")
    ray.get([src.connect.remote([sink], 0), sink.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    src_ref, sink_ref = src.run.remote(), sink.run.remote()
    runs = {src_ref: "source", sink_ref: "sink"}
    time.sleep(0.5)
    ray.kill(sink, no_restart=True)
    with pytest.raises(ray.exceptions.RayError) as info:  # the source's send to the dead sink fails
        ray.get(src_ref, timeout=RAY_CALL_GUARD_S)
    assert not isinstance(info.value, ray.exceptions.RayActorError)  # the source itself is alive
    stage, cause = blame_stage(runs, src_ref, info.value, [sink_ref])
    assert stage == "sink" and isinstance(cause, ray.exceptions.RayActorError)
    ray.kill(src)
