"""A run's timeline (`+trainer.async_trace_path=DIR`): each process records spans on its tracks, the
driver gathers them, aligns the clocks and writes one Chrome-trace / Perfetto file, `DIR/trace.json`
(open it in https://ui.perfetto.dev or chrome://tracing).

- `TraceRecorder`: one process's events. Off, every call returns at once; on, a span costs one
  tuple append (and a dict entry while it runs: a pop shows running spans as `open`). At most `max_events` are kept between two `pop`s (the oldest dropped, counted).
- `clock_offset`: how far a process's clock is from the driver's, from the quickest of a few round trips
  (seconds); a process on the driver's host shares its clock (`same_clock`) and needs none.
- `write_trace`: the gathered events as Chrome-trace JSON, one process per track owner (a stage,
  a replica, a train rank) and one thread per track.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Optional

TRACE_FILE = "trace.json"  # the timeline's file in +trainer.async_trace_path
Event = tuple  # (track, name, start_s, end_s, args): start and end in time.time() seconds


class TraceRecorder:
    """Spans of one owner (`owner`: e.g. "stage generate"); tracks name lanes within it.

    Args:
        enabled: record (False: every call is a no-op).
        max_events: events kept until the next `pop` (older ones dropped and counted in `dropped`).
    """

    def __init__(self, owner: str, enabled: bool = False, max_events: int = 200_000):
        self.owner, self.enabled = owner, enabled
        self._events: collections.deque = collections.deque(maxlen=max_events)
        self._open: dict[int, tuple] = {}  # spans begun and not yet ended: key -> (track, name, start_s, args)
        self._next_key = 0
        self.dropped = 0

    def enable(self, on: bool = True) -> None:
        self.enabled = on

    def add(self, track: str, name: str, start_s: float, end_s: float, **args: Any) -> None:
        """Record a span [start_s, end_s] (time.time() seconds) on `track`."""
        if not self.enabled:
            return
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append((track, name, start_s, end_s, args))

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """Record the time the block takes as a span (also when it raises)."""
        if not self.enabled:
            yield
            return
        start, key = time.time(), self._next_key
        self._next_key += 1
        self._open[key] = (track, name, start, args)
        try:
            yield
        finally:
            del self._open[key]
            self.add(track, name, start, time.time(), **args)

    def pop(self) -> dict:
        """The events recorded since the last pop: {"owner", "host", "now_s" (this clock), "events",
        "dropped"}; the spans still running end at now_s with `open: True` (what a hung stage was doing)."""
        now = time.time()
        events, self._events = list(self._events), collections.deque(maxlen=self._events.maxlen)
        events += [(track, name, start, now, {**args, "open": True}) for track, name, start, args in self._open.values()]
        dropped, self.dropped = self.dropped, 0
        return {"owner": self.owner, "host": socket.gethostname(), "now_s": now, "events": events, "dropped": dropped}


class BusyPeriods:
    """Work that overlaps (requests on one replica) as one track of spans that do not: a span runs
    from the moment the first of a set of overlapping items starts to the moment the last ends,
    with `items` (how many it held) and what `note` counted (e.g. `interrupted`)."""

    def __init__(self, recorder: TraceRecorder, track: str, name: str):
        self.recorder, self.track, self.name = recorder, track, name
        self._active, self._start, self._args = 0, 0.0, {}

    def note(self, what: str) -> None:
        """Count `what` in the running span's args."""
        self._args[what] = self._args.get(what, 0) + 1

    @contextlib.contextmanager
    def item(self) -> Iterator[None]:
        """One item of work for as long as the block runs."""
        if self._active == 0:
            self._start, self._args = time.time(), {"items": 0}
        self._active += 1
        self._args["items"] += 1
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0:
                self.recorder.add(self.track, self.name, self._start, time.time(), **self._args)


def same_clock(batch: Mapping) -> bool:
    """Whether a popped batch comes from this host, whose processes all read one system clock (offset 0)."""
    return batch.get("host") == socket.gethostname()


def clock_offset(read_remote_clock: Callable[[], float], round_trips: int = 3) -> float:
    """Seconds to add to a remote process's time.time() to get this process's, from the quickest of
    `round_trips` round trips: the remote read is taken to happen halfway (error: at most half that
    round trip; a reply held up in a busy process only lengthens the trips not chosen)."""
    best_trip, best = float("inf"), 0.0
    for _ in range(max(1, round_trips)):
        sent = time.time()
        remote = read_remote_clock()
        received = time.time()
        if received - sent < best_trip:
            best_trip, best = received - sent, (sent + received) / 2 - remote
    return best


def chrome_events(batches: Sequence[Mapping], offsets: Optional[Mapping[str, float]] = None) -> list[dict]:
    """Chrome-trace events ("X" spans in microseconds, plus process and thread names) of popped
    `batches`; `offsets`: owner -> seconds added to its times (`clock_offset`). Spans of one track
    that overlap (a stage working on two batches at once) go to threads of the same name, as
    Chrome-trace viewers need the spans of one thread nested."""
    offsets = offsets or {}
    pids: dict[str, int] = {}
    lanes: dict[tuple[str, str], list[list]] = {}  # (owner, track) -> [[tid, end of its last span], ...]
    out: list[dict] = []
    for batch in batches:
        owner = batch["owner"]
        if owner not in pids:
            pids[owner] = len(pids) + 1
            out.append({"ph": "M", "name": "process_name", "pid": pids[owner], "args": {"name": owner}})
        shift = offsets.get(owner, 0.0)
        for track, name, start, end, args in sorted(batch["events"], key=lambda e: e[2]):
            lanes_of = lanes.setdefault((owner, track), [])
            lane = next((lane for lane in lanes_of if lane[1] <= start), None)
            if lane is None:
                lane = [sum(len(v) for v in lanes.values()) + 1, start]
                lanes_of.append(lane)
                out.append({"ph": "M", "name": "thread_name", "pid": pids[owner], "tid": lane[0],
                            "args": {"name": track}})
            lane[1] = end
            out.append({"ph": "X", "name": name, "cat": track, "pid": pids[owner], "tid": lane[0],
                        "ts": (start + shift) * 1e6, "dur": max(0.0, end - start) * 1e6, "args": args})
    return out


def write_trace(path: str, batches: Sequence[Mapping], offsets: Optional[Mapping[str, float]] = None,
                run: Optional[Mapping[str, Any]] = None) -> str:
    """Write `batches` as one Chrome-trace JSON file at `path` (its folder made); returns the path.
    `run`: the run's settings a reader needs (e.g. generate_ahead_steps), kept in `otherData.run`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    dropped = {b["owner"]: b["dropped"] for b in batches if b.get("dropped")}
    document = {"traceEvents": chrome_events(batches, offsets), "displayTimeUnit": "ms",
                "otherData": {"dropped_events": dropped, "run": dict(run or {})}}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(document, f)
    os.replace(tmp, path)
    return path
