"""The rollout servers the generate stage sends requests to, and the restart of a lost one.

A server is lost when a request to it fails because its process is gone (Ray's
`RayActorError`: killed, OOM, node lost) or when it does not answer within
`actor_rollout_ref.rollout.request_timeout_s` (then it is killed). With
`actor_rollout_ref.rollout.max_restarts` = N > 0 the supervisor starts a fresh server for that
replica (`relaunch`), has it load the newest weights before it serves (`feed_weights`: the
param_update stage, under its sync lock), and meanwhile hands requests to the surviving
servers. A replica lost more than N times, a restart that fails, or N = 0 stops the run with a
`ReplicaLostError` naming the replica, the cause and the key.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Optional

from async_rl.core.timeouts import SETUP_TIMEOUT_S
from async_rl.core.trace import BusyPeriods, TraceRecorder

logger = logging.getLogger(__name__)

MAX_RESTARTS_KEY = "actor_rollout_ref.rollout.max_restarts"
REQUEST_TIMEOUT_KEY = "actor_rollout_ref.rollout.request_timeout_s"


class ReplicaLostError(RuntimeError):
    """A rollout replica was lost and is not (or can no longer be) restarted."""


class ReplicaSupervisor:
    """Server handles by replica index; restarts a lost replica up to `max_restarts` times.

    Args:
        handles: one server handle per replica (verl's `RolloutReplica.server_handle`).
        max_restarts: restarts allowed per replica over the run (0: a lost replica stops the run).
        relaunch: `async relaunch(index, attempt) -> new handle` (a fresh server on the replica's resources).
        feed_weights: `async feed_weights(index, handle) -> version` (the newest weights, loaded).
        kill: `kill(handle)`, used on a server that stopped answering (default: `ray.kill`).
        restart_timeout_s: a restart (start + weights) may take this long (s); a restart is a start, so the
            default is the run's setup bound (async_rl/core/timeouts.py).
        trace: the timeline's recorder (the generate stage's): per replica, its serving periods (track
            `replica <i>`), losses and restarts.
    """

    def __init__(
        self,
        handles: list,
        max_restarts: int = 0,
        relaunch: Optional[Callable[[int, int], Awaitable[Any]]] = None,
        feed_weights: Optional[Callable[[int, Any], Awaitable[int]]] = None,
        kill: Optional[Callable[[Any], None]] = None,
        restart_timeout_s: float = SETUP_TIMEOUT_S,
        trace: Optional[TraceRecorder] = None,
    ):
        if not handles:
            raise ValueError("at least one rollout server is needed")
        if max_restarts and (relaunch is None or feed_weights is None):
            raise ValueError("max_restarts > 0 needs relaunch and feed_weights")
        self.handles = list(handles)
        self.max_restarts = int(max_restarts)
        self._relaunch, self._feed_weights = relaunch, feed_weights
        self._kill = kill or kill_actor
        self.restart_timeout_s = restart_timeout_s
        self.restarts = [0] * len(self.handles)
        self.requests_resubmitted = 0
        self._ready = [asyncio.Event() for _ in self.handles]
        for event in self._ready:
            event.set()
        self._any_ready = asyncio.Event()
        self._any_ready.set()
        self._tasks: set[asyncio.Task] = set()
        self.failure: Optional[ReplicaLostError] = None
        self.trace = trace or TraceRecorder("replicas")
        self._serving = [BusyPeriods(self.trace, f"replica {i}", "serving") for i in range(len(self.handles))]

    # ------------------------------------------------------------------ requests

    def ready(self, index: int) -> bool:
        return self._ready[index].is_set()

    async def acquire(self, preferred: int) -> tuple[int, Any]:
        """(index, handle) of a serving replica: `preferred` if it serves, else the next one that does;
        waits (up to `restart_timeout_s`) while none does. Raises the failure that stopped restarts."""
        deadline = asyncio.get_running_loop().time() + self.restart_timeout_s
        while True:
            if self.failure is not None:
                raise self.failure
            count = len(self.handles)
            for offset in range(count):
                index = (preferred + offset) % count
                if self._ready[index].is_set():
                    return index, self.handles[index]
            self._any_ready.clear()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise ReplicaLostError(f"no rollout server came back within {self.restart_timeout_s:g} s "
                                       f"(restarts so far: {self.restarts})")
            try:
                await asyncio.wait_for(self._any_ready.wait(), timeout=min(left, 1.0))
            except asyncio.TimeoutError:
                pass

    async def all_ready(self) -> list:
        """Every replica's handle once none is restarting (up to `restart_timeout_s`); raises the failure
        that stopped restarts."""
        try:
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in self._ready)), self.restart_timeout_s)
        except asyncio.TimeoutError:
            if self.failure is None:
                raise ReplicaLostError(f"a rollout replica did not come back within {self.restart_timeout_s:g} s "
                                       f"(restarts so far: {self.restarts})") from None
        if self.failure is not None:
            raise self.failure
        return list(self.handles)

    @contextlib.contextmanager
    def serving(self, index: int) -> Iterator[BusyPeriods]:
        """A request on replica `index` for as long as the block runs (its timeline track)."""
        with self._serving[index].item():
            yield self._serving[index]

    def counts(self) -> dict[str, float]:
        """Faults so far, under the pipeline's metric names (cumulative over the run)."""
        return {
            "async/faults/replica_restarts": float(sum(self.restarts)),
            "async/faults/requests_resubmitted": float(self.requests_resubmitted),
        }

    # ------------------------------------------------------------------ losses

    def lost(self, index: int, handle: Any, cause: str, hung: bool = False) -> None:
        """Server `index` (the one behind `handle`) is lost because of `cause`; `hung`: it is still
        running but stopped answering, so it is killed first. A report about a handle already replaced,
        or already being restarted, is ignored. Raises ReplicaLostError when no restart is allowed."""
        if self.failure is not None:
            raise self.failure
        if handle != self.handles[index] or not self._ready[index].is_set():  # Ray handles: equal actor ids
            return
        self._ready[index].clear()
        if hung:
            self._kill(handle)
        name = f"rollout replica {index}"
        if self.max_restarts == 0:
            self._fail(f"{name} was lost ({cause}); {MAX_RESTARTS_KEY}=0 does not restart it")
        if self.restarts[index] >= self.max_restarts:
            self._fail(f"{name} was lost {self.restarts[index] + 1} times, the last: {cause}; "
                       f"{MAX_RESTARTS_KEY}={self.max_restarts} restarts allowed")
        self.restarts[index] += 1
        logger.warning("%s lost (%s): restart %d of %d", name, cause, self.restarts[index], self.max_restarts)
        now = time.time()
        self.trace.add(f"replica {index}", "lost", now, now, cause=cause)
        task = asyncio.ensure_future(self._restart(index, self.restarts[index], cause))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, index: int, attempt: int, cause: str) -> None:
        started = time.time()
        try:
            handle = await asyncio.wait_for(self._relaunch(index, attempt), timeout=self.restart_timeout_s)
            version = await asyncio.wait_for(self._feed_weights(index, handle), timeout=self.restart_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure of a restart stops the run, named
            self._fail(f"rollout replica {index} was lost ({cause}) and its restart {attempt} failed: "
                       f"{type(exc).__name__}: {exc}", raise_it=False)
            return
        self.handles[index] = handle
        self.trace.add(f"replica {index}", "restart", started, time.time(), attempt=attempt, version=version)
        self._ready[index].set()
        self._any_ready.set()
        logger.warning("rollout replica %d back (restart %d), serving weight version %s", index, attempt, version)

    def _fail(self, message: str, raise_it: bool = True) -> None:
        self.failure = ReplicaLostError(message)
        for event in (*self._ready, self._any_ready):  # every waiter wakes up and sees the failure
            event.set()
        if raise_it:
            raise self.failure


def kill_actor(handle: Any) -> None:
    """ray.kill, without restart; an actor already gone is what we wanted."""
    import ray

    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
