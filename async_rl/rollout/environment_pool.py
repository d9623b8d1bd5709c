"""A pool of environments with limited concurrency (a sandbox, a search API), shared by every
trajectory of the generate stage: a trajectory takes one when it needs one and gives it back when
done, so a slow trajectory holds one only while it uses it (seed 004, RL2's environment pool)."""

from __future__ import annotations

import asyncio
import time

from async_rl.core.errors import AsyncConfigError

TOOL_POOL_SIZE_KEY = "actor_rollout_ref.rollout.multi_turn.tool_pool_size"


class EnvironmentPoolTimeout(TimeoutError):
    """No environment of the pool came free within the wait bound."""


class EnvironmentPool:
    """At most `size` environments in use at once. `acquire()` waits for a free one, at most
    `wait_timeout_s` (s), and returns the seconds it waited; `release()` gives one back. A wait past the
    bound raises EnvironmentPoolTimeout naming the pool and `TOOL_POOL_SIZE_KEY`. Create it inside the
    event loop that uses it."""

    def __init__(self, name: str, size: int, wait_timeout_s: float):
        if size < 1:
            raise AsyncConfigError(TOOL_POOL_SIZE_KEY, size, "an integer >= 1, or null for no limit")
        self.name, self.size, self.wait_timeout_s = name, size, wait_timeout_s
        self._free = asyncio.Semaphore(size)

    @property
    def in_use(self) -> int:
        """Environments taken now."""
        return self.size - self._free._value

    async def acquire(self) -> float:
        started = time.perf_counter()
        try:
            await asyncio.wait_for(self._free.acquire(), self.wait_timeout_s)
        except asyncio.TimeoutError:
            raise EnvironmentPoolTimeout(
                f"no {self.name!r} environment came free within {self.wait_timeout_s:g} s: all {self.size} in "
                f"use ({TOOL_POOL_SIZE_KEY})") from None
        return time.perf_counter() - started

    def release(self) -> None:
        if self.in_use <= 0:
            raise RuntimeError(f"{self.name!r} pool: a release without an acquire")
        self._free.release()
