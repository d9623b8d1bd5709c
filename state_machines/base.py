"""The abstract async state machine every pipeline stage subclasses.

A stage is a producer/consumer: `get_input_data` -> `process_data` -> `send_output_data`;
a subclass writes `process_data` (the other two default to the inbox and every downstream).
The base class owns everything else:

- the loop, with up to `max_inflight` items processed concurrently and outputs sent in
  input order;
- a bounded inbox (`inbox_size` items): an upstream's `put` awaits while it is full,
  which is the backpressure that keeps fast stages from running away;
- end of stream: a stage ends once every upstream has sent `END_OF_STREAM`, after
  draining what it holds, and then sends `END_OF_STREAM` downstream;
- busy/idle timing (seconds with at least one item in `process_data`);
- a timeline when asked (`enable_trace`, `pop_trace`): each item's work, each wait for input and
  each wait on a full downstream inbox, as spans (async_rl/core/trace.py);
- `stop()` (cancel now) and `drain()` (take no new input, finish what is held);
- errors: an exception in any method ends `run()` with `StageError` naming the stage
  and the original exception; the pipeline driver stops the whole run on it.

Downstreams are Ray actor handles (`handle.put.remote`) or, in tests, local stages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import traceback
from abc import ABC, abstractmethod
from typing import Any, Optional

from async_rl.core.trace import TraceRecorder
from verl_patches.tensordict_threads import patch_per_thread_device_recorder


class _EndOfStream:
    """Sentinel sent downstream when a stage has no more output."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self):  # stays a singleton across Ray serialization
        return (_EndOfStream, ())

    def __repr__(self) -> str:
        return "END_OF_STREAM"


END_OF_STREAM = _EndOfStream()


class StageError(RuntimeError):
    """A stage failed; the message names the stage and the original exception."""

    def __init__(self, stage: str, original: BaseException, where: str):
        self.stage = stage
        self.original_type = type(original).__name__
        tb = "".join(traceback.format_exception(type(original), original, original.__traceback__))
        super().__init__(
            f"stage '{stage}' failed in {where}: {type(original).__name__}: {original}\n--- original traceback ---\n{tb}"
        )

    def __reduce__(self):  # picklable (Ray sends it to the driver): rebuild from the message
        return (_rebuild_stage_error, (self.stage, self.original_type, self.args[0]))


def _rebuild_stage_error(stage: str, original_type: str, message: str) -> StageError:
    err = StageError.__new__(StageError)
    RuntimeError.__init__(err, message)
    err.stage, err.original_type = stage, original_type
    return err


async def call_put(target: Any, item: Any) -> None:
    """`await target.put(item)` for a Ray actor handle or a local stage."""
    put = target.put
    if hasattr(put, "remote"):
        await put.remote(item)
    else:
        await put(item)


class BusyTimer:
    """Seconds with at least one item being processed, since `start()`."""

    def __init__(self):
        self.started_at: Optional[float] = None
        self._busy_total = 0.0
        self._active = 0
        self._active_since = 0.0

    def start(self) -> None:
        self.started_at = time.perf_counter()

    def enter(self) -> None:
        if self._active == 0:
            self._active_since = time.perf_counter()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._busy_total += time.perf_counter() - self._active_since

    @contextlib.contextmanager
    def paused(self):
        """Inside an entered item: the time under this block counts as idle (a wait on others)."""
        self.leave()
        try:
            yield
        finally:
            self.enter()

    def busy_s(self) -> float:
        extra = time.perf_counter() - self._active_since if self._active else 0.0
        return self._busy_total + extra

    def wall_s(self) -> float:
        return 0.0 if self.started_at is None else time.perf_counter() - self.started_at


class StateMachine(ABC):
    """Abstract pipeline stage; subclasses implement the three data methods.

    Args:
        name: stage name used in metrics (`async/<name>/busy_ratio`) and errors.
        inbox_size: items the inbox holds before upstream `put` calls wait.
        max_inflight: items processed concurrently (outputs keep input order).
    """

    def __init__(self, name: str, inbox_size: int = 2, max_inflight: int = 1):
        if inbox_size < 1 or max_inflight < 1:
            raise ValueError(f"stage '{name}': inbox_size and max_inflight must be >= 1")
        patch_per_thread_device_recorder()  # a stage's worker-group calls run in threads, several at once
        self.name = name
        self.inbox_size = inbox_size
        self.max_inflight = max_inflight
        self.downstream: list[Any] = []
        self.num_upstreams = 0
        self._inbox: Optional[asyncio.Queue] = None
        self._ends_seen = 0
        self._draining = False
        self._stopped = False
        self._run_task: Optional[asyncio.Task] = None
        self._get_task: Optional[asyncio.Task] = None
        self._where = "on_start"
        self.items_processed = 0
        self.timer = BusyTimer()
        self.trace = TraceRecorder(f"stage {name}")

    # ---- wiring -------------------------------------------------------------------
    def connect(self, downstream: list[Any], num_upstreams: int) -> None:
        """Set where outputs go and how many upstreams must end before this stage ends."""
        self.downstream = list(downstream)
        self.num_upstreams = num_upstreams

    @property
    def inbox(self) -> asyncio.Queue:
        if self._inbox is None:  # created inside the running event loop
            self._inbox = asyncio.Queue(maxsize=self.inbox_size)
        return self._inbox

    async def put(self, item: Any) -> None:
        """Called by upstreams; waits while the inbox is full (backpressure)."""
        await self.inbox.put(item)

    # ---- helpers for subclasses ------------------------------------------------------
    async def next_from_inbox(self) -> Any:
        """Next upstream item, or END_OF_STREAM once every upstream has ended."""
        while True:
            if self._ends_seen >= self.num_upstreams:
                return END_OF_STREAM
            if self.trace.enabled and self.inbox.empty():
                started = time.time()
                item = await self.inbox.get()
                self.trace.add("wait", "wait input", started, time.time())
            else:
                item = await self.inbox.get()
            if item is END_OF_STREAM:
                self._ends_seen += 1
                continue
            return item

    async def send_downstream(self, item: Any) -> bool:
        """Put `item` into every downstream inbox (waits on full inboxes)."""
        with self.trace.span("wait", "wait downstream", **self.trace_args(item) if self.trace.enabled else {}):
            await asyncio.gather(*(call_put(d, item) for d in self.downstream))
        return True

    # ---- the three methods a stage implements ----------------------------------------
    async def get_input_data(self) -> Optional[Any]:
        """Next unit of work, or END_OF_STREAM when there is no more (default: the next inbox item;
        override to join or reorder upstream items)."""
        return await self.next_from_inbox()

    @abstractmethod
    async def process_data(self, data: Any) -> Any:
        """Do the stage's work on one unit; return the output (None: nothing to send)."""

    async def send_output_data(self, data: Any) -> bool:
        """Send one output downstream; return True when sent (default: to every downstream inbox;
        override to route)."""
        return await self.send_downstream(data)

    # ---- lifecycle ----------------------------------------------------------------
    async def on_start(self) -> None:
        """Hook: runs once in the stage's event loop before the first item."""

    async def on_end(self) -> None:
        """Hook: runs once after the last output, before END_OF_STREAM goes downstream."""

    def waiting(self):
        """In `process_data`: `with self.waiting(): await ...` keeps a wait on another stage (not
        work of this one) out of the busy time; the item stays in flight, so drain still finishes it."""
        return self.timer.paused()

    def trace_args(self, data: Any) -> dict:
        """What the timeline shows with an item's work span (default: its batch `index` and the `version`
        it was generated from, `start_version`, where it has them; of a dict of messages, the first's)."""
        if isinstance(data, dict) and data:
            data = next(iter(data.values()))
        index = getattr(data, "index", data if isinstance(data, int) else None)
        version = getattr(data, "start_version", None)
        return {k: v for k, v in (("index", index), ("version", version)) if v is not None}

    async def _process_timed(self, data: Any) -> Any:
        self.timer.enter()
        try:
            with self.trace.span("work", "process", **(self.trace_args(data) if self.trace.enabled else {})):
                return await self.process_data(data)
        finally:
            self.timer.leave()

    async def run(self) -> dict:
        """The stage loop; returns final stats. Raises StageError on any failure."""
        self._run_task = asyncio.current_task()
        self.timer.start()
        self._where = "on_start"
        inflight: collections.deque[asyncio.Task] = collections.deque()
        try:
            await self.on_start()
            while not self._stopped:
                while inflight and (len(inflight) >= self.max_inflight or inflight[0].done()):
                    await self._emit_oldest(inflight)
                if self._draining:
                    break
                self._where = "get_input_data"
                data = await self._get_input_or_wake(inflight)
                if data is END_OF_STREAM:
                    break
                inflight.append(asyncio.ensure_future(self._process_timed(data)))
            while inflight and not self._stopped:
                await self._emit_oldest(inflight)
            self._where = "on_end"
            await self.on_end()
            if not self._stopped:
                self._where = "send END_OF_STREAM"
                await self.send_downstream(END_OF_STREAM)
        except asyncio.CancelledError:
            for task in inflight:
                task.cancel()
            if not self._stopped:
                raise
        except StageError:
            raise
        except BaseException as exc:  # noqa: BLE001 - re-raised with the stage's name
            for task in inflight:
                task.cancel()
            raise StageError(self.name, exc, self._where) from exc
        return self.stats()

    async def _emit_oldest(self, inflight: collections.deque) -> None:
        """Wait for the oldest in-flight item and send its output (outputs keep input order)."""
        self._where = "process_data"
        out = await inflight.popleft()
        self.items_processed += 1
        if out is not None:
            self._where = "send_output_data"
            await self.send_output_data(out)

    async def _get_input_or_wake(self, inflight) -> Any:
        """Await the next input; meanwhile send in-flight outputs as they finish, in order."""
        get_task = self._get_task = asyncio.ensure_future(self.get_input_data())
        try:
            while inflight and not get_task.done():
                await asyncio.wait({get_task, inflight[0]}, return_when=asyncio.FIRST_COMPLETED)
                if inflight[0].done():
                    await self._emit_oldest(inflight)
                    self._where = "get_input_data"
            try:
                return await get_task
            except asyncio.CancelledError:
                if self._draining and get_task.cancelled() and not asyncio.current_task().cancelling():
                    return END_OF_STREAM  # drain() cancelled the wait for new input
                raise
        except BaseException:
            get_task.cancel()
            raise

    def drain(self) -> None:
        """Take no new input; finish the items in flight, then end normally."""
        self._draining = True
        if self._get_task is not None and not self._get_task.done():
            self._get_task.cancel()

    def stop(self) -> None:
        """Stop now: cancel the loop and anything in flight; no END_OF_STREAM is sent."""
        self._stopped = True
        if self._run_task is not None and not self._run_task.done():
            self._run_task.cancel()

    def enable_trace(self, on: bool = True) -> None:
        """Record this stage's timeline from now on (`+trainer.async_trace_path`)."""
        self.trace.enable(on)

    def pop_trace(self) -> dict:
        """The timeline recorded since the last call (`TraceRecorder.pop`)."""
        return self.trace.pop()

    def clock(self) -> float:
        """This process's time.time() (the driver aligns the timelines with it: `clock_offset`)."""
        return time.time()

    def stats(self) -> dict:
        """Cumulative timing: busy seconds, wall seconds, items processed."""
        return {
            "name": self.name,
            "busy_s": self.timer.busy_s(),
            "wall_s": self.timer.wall_s(),
            "items": self.items_processed,
            "inbox": self._inbox.qsize() if self._inbox is not None else 0,
        }
