"""The policy clock: the pipeline's versions in one place, and the one staleness gate applied to them.

`PolicyClock` holds
- the served version: the newest weights every rollout server serves (param_update publishes it
  once a version is loaded everywhere);
- the trainer's version: the updates done (actor_train publishes it after each step);
- the steps formed: the training batches formed (dynamic_sampling publishes it; without dynamic
  sampling each generated batch is one, and the count stays at the start step);
- the rollout servers a weight sync found lost (param_update reports them; the generate stage's
  supervisor, their one owner, restarts them).

A stage is given a `ClockRef`: the `StalenessGate` (async_rl/core/staleness.py), the one rule every
stage applies, and the clock's handle. The clock runs in the generate stage's process (beside it
in its node's StageHost, or in an actor of its own with `trainer.stage_processes=per_stage`);
writers call it once per version or step. The generate stage, which reads the versions on its hot
path (each admission, each request), reads them from a `ClockView`: a copy kept current by one
call that the clock answers at each change, so a read costs no call. A copy may lag the clock,
never lead it: generation admitted against it is admitted no earlier than against the clock, so
the bound holds as it does on the clock itself.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

from async_rl.core.staleness import StalenessGate


class _Changed:
    """Waiters woken together at each change; each waiter's future belongs to its own event loop."""

    def __init__(self):
        self._waiters: list[asyncio.Future] = []

    async def wait(self) -> None:
        future = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            await future
        finally:
            if future in self._waiters:
                self._waiters.remove(future)

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done() and not future.get_loop().is_closed():
                future.set_result(None)


class PolicyClock:
    """The versions and the lost-server reports (a Ray actor's object, or in-process: `ClockRef.in_process`).

    Args:
        start_step: the trainer's version at start (a resumed run's step): the steps formed start there.
    """

    def __init__(self, start_step: int = 0):
        self._versions = {"served_version": 0, "trained_version": start_step, "steps_formed": start_step}
        self._lost: list[tuple] = []
        self._seq = 0  # bumped at each change
        self._changed = _Changed()

    def set_served_version(self, version: int) -> None:
        """Every rollout server serves `version` (param_update, after the load)."""
        self._advance("served_version", version)

    def set_trained_version(self, version: int) -> None:
        """The trainer has made `version` updates (actor_train, after each step)."""
        self._advance("trained_version", version)

    def set_steps_formed(self, steps: int) -> None:
        """`steps` training batches are formed (dynamic_sampling, after each)."""
        self._advance("steps_formed", steps)

    def report_lost(self, replica_index: int, handle: Any, cause: str, hung: bool = False) -> None:
        """A weight sync found rollout server `handle` of replica `replica_index` gone (or, `hung`, silent)."""
        self._lost.append((replica_index, handle, cause, hung))
        self._bump()

    def versions(self) -> dict[str, int]:
        """served_version, trained_version, steps_formed."""
        return dict(self._versions)

    async def follow(self, seen: int, lost_seen: int) -> tuple[int, dict[str, int], list[tuple]]:
        """Once the clock has changed since change `seen` (-1: at once): (change number, the versions,
        the lost-server reports after the first `lost_seen`)."""
        while self._seq == seen:
            await self._changed.wait()
        return self._seq, self.versions(), self._lost[lost_seen:]

    def _advance(self, name: str, value: int) -> None:
        if value < self._versions[name]:
            raise ValueError(f"{name.replace('_', ' ')} went back from {self._versions[name]} to {value}")
        self._versions[name] = int(value)
        self._bump()

    def _bump(self) -> None:
        self._seq += 1
        self._changed.notify()


class InProcess:
    """An object called as a Ray actor handle is (`handle.method.remote(*args)`, awaitable), in this process."""

    def __init__(self, target: Any):
        self.target = target

    def __getattr__(self, name: str) -> "_LocalMethod":
        if name.startswith("__") or name == "target":
            raise AttributeError(name)
        return _LocalMethod(getattr(self.target, name))


class _LocalMethod:
    __slots__ = ("_method",)

    def __init__(self, method: Callable):
        self._method = method

    def remote(self, *args, **kwargs):
        result = self._method(*args, **kwargs)  # a plain method runs now, as a Ray call is sent now
        return result if inspect.isawaitable(result) else _done(result)


async def _done(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class ClockRef:
    """What a stage is given: the rule (`gate`) and the clock's handle (`handle.method.remote(...)`)."""

    gate: StalenessGate
    handle: Any

    @classmethod
    def in_process(cls, gate: StalenessGate, start_step: int = 0) -> "ClockRef":
        """A clock in this process (stages driven without Ray)."""
        return cls(gate, InProcess(PolicyClock(start_step)))

    def view(self, on_lost: Optional[Callable[[int, Any, str, bool], None]] = None) -> "ClockView":
        """A copy of the clock for a stage that reads it often; `on_lost(replica_index, handle, cause, hung)`
        gets each lost-server report, in the stage's event loop."""
        return ClockView(self.handle, on_lost)


class ClockView:
    """A stage's copy of the clock, kept current while the stage's event loop runs (`follow` starts it)."""

    def __init__(self, handle: Any, on_lost: Optional[Callable[[int, Any, str, bool], None]] = None):
        self._handle, self._on_lost = handle, on_lost
        self.served_version, self.trained_version, self.steps_formed = 0, 0, 0
        self._seq, self._lost_seen = -1, 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._current: Optional[asyncio.Future] = None  # done once the copy holds the clock's state
        self._task: Optional[asyncio.Task] = None
        self._changed = _Changed()
        self._error: Optional[BaseException] = None

    async def follow(self) -> "ClockView":
        """Follow the clock from this event loop (started once per loop); returns once the copy holds the
        clock's state. Raises when the clock stopped answering."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._loop, self._error, self._seq = loop, None, -1
            self._current = loop.create_future()
            self._task = loop.create_task(self._follow())
        await asyncio.shield(self._current)
        self._raise_if_stopped()
        return self

    async def wait_until(self, ready: Callable[[], bool]) -> None:
        """Wait until `ready()` holds; checked again at each change of the copy."""
        await self.follow()
        while not ready():
            await self._changed.wait()
            self._raise_if_stopped()

    async def _follow(self) -> None:
        try:
            while True:
                self._seq, versions, lost = await self._handle.follow.remote(self._seq, self._lost_seen)
                self.served_version = versions["served_version"]
                self.trained_version = versions["trained_version"]
                self.steps_formed = versions["steps_formed"]
                self._lost_seen += len(lost)
                for report in lost:
                    if self._on_lost is not None:
                        self._on_lost(*report)
                if not self._current.done():
                    self._current.set_result(None)
                self._changed.notify()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every reader raises it
            self._error = exc
            if not self._current.done():
                self._current.set_result(None)
            self._changed.notify()

    def _raise_if_stopped(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the policy clock stopped answering: {type(self._error).__name__}: "
                               f"{self._error}") from self._error
