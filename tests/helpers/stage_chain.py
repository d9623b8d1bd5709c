"""A three-stage chain of real state machines for tests: Source (emits 0..n-1) -> SlowMapper -> Sink."""

from __future__ import annotations

import asyncio

from state_machines.base import END_OF_STREAM, StateMachine


class Source(StateMachine):
    """Emits 0..n-1, then END_OF_STREAM."""

    def __init__(self, n: int):
        super().__init__("source")
        self.n, self.emitted = n, 0

    async def get_input_data(self):
        if self.emitted >= self.n:
            return END_OF_STREAM
        self.emitted += 1
        return self.emitted - 1

    async def process_data(self, data):
        return data


class Sink(StateMachine):
    def __init__(self):
        super().__init__("sink")

    async def process_data(self, data):
        return None


def chain(*stages):
    for i, stage in enumerate(stages):
        stage.connect([stages[i + 1]] if i + 1 < len(stages) else [], 0 if i == 0 else 1)


class SlowMapper(StateMachine):
    """Passes items on after `delay` seconds (a slow middle stage: its upstream waits on it)."""

    def __init__(self, delay: float):
        super().__init__("mapper", inbox_size=1)
        self.delay = delay

    async def process_data(self, data):
        await asyncio.sleep(self.delay)
        return data


def traced_run(n: int, delay: float) -> list[dict]:
    """Run Source(n) -> SlowMapper(delay) -> Sink with their timelines on (30 s at most); their popped traces."""
    stages = (Source(n), SlowMapper(delay=delay), Sink())
    chain(*stages)
    for stage in stages:
        stage.enable_trace()

    async def main():
        await asyncio.gather(*(stage.run() for stage in stages))

    asyncio.run(asyncio.wait_for(main(), 30))
    return [stage.pop_trace() for stage in stages]

