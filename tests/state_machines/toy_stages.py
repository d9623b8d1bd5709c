"""The stages the StateMachine tests (test_state_machine_*.py) wire together: a Source, a Mapper that records
its concurrency and cancellations, a Sink, a Recorder (any object with an async `put`), and `chain`, `feed`
and `run` to wire, feed and run them. Their timeouts only catch hangs: every limit is far above what a
step needs."""

import asyncio

from state_machines.base import END_OF_STREAM, StateMachine


HANG_S = 10  # generous limit that only a hang reaches


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


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
