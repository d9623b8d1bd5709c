"""The numbers of a run's report, from its timeline (`TRACE_DIR/trace.json`, async_rl/core/trace.py)
and, where given, its metrics (verl's `file` logger JSONL, `VERL_FILE_LOGGER_PATH`). Seconds throughout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

STAGE_PREFIX = "stage "
REPLICA_PREFIX = "replica "  # the generate stage's tracks of each rollout replica
WAITS = {"wait input": "waiting for input", "wait downstream": "waiting on a full downstream inbox",
         "admission (staleness bound)": "held by the staleness bound"}
SYNC_PARTS = ("gather", "send", "recv", "register-buffer", "load")  # the five parts: their spans' names per version


class ReportError(ValueError):
    """The timeline or the metrics cannot be read (the message names the file and what is wrong)."""


def union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end] spans as sorted, disjoint spans."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def covered_s(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end] spans (overlaps counted once)."""
    return sum(b - a for a, b in union(spans))


def outside_s(spans: Iterable[tuple[float, float]], taken: Iterable[tuple[float, float]]) -> float:
    """Seconds of the union of `spans` that lie outside the union of `taken`."""
    own, taken = union(spans), union(taken)
    return covered_s(own) - covered_s((max(a, c), min(b, d)) for a, b in own for c, d in taken if min(b, d) > max(a, c))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linear between the two nearest ranks."""
    ordered_values = sorted(values)
    rank = (len(ordered_values) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered_values) - 1)
    return ordered_values[low] + (ordered_values[high] - ordered_values[low]) * (rank - low)


@dataclass
class StageTime:
    """One stage over the timeline's window: busy s (the union of its work spans), each wait's s (the union
    of its spans: several items waiting at once count once), items."""

    busy_s: float = 0.0
    waits_s: dict[str, float] = field(default_factory=dict)
    items: int = 0
    shares_s: dict[str, float] = field(default_factory=dict)  # the window split without overlap: "busy", then
    # each wait of WAITS where the stage is neither busy nor in an earlier wait, then "idle"; sums to the window


@dataclass
class Timeline:
    """What the report takes from trace.json: the window (s), each stage's time, each version's
    weight-sync parts (version -> part -> s; a receiver part is the slowest receiver's), the run's settings."""

    window_s: float
    start_s: float  # the window's start, time.time() seconds
    stages: dict[str, StageTime]
    sync: dict[int, dict[str, float]]
    run: dict
    dropped: dict
    work_spans: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)  # stage -> (start, end
    # s from the window's start, title)
    replica_spans: dict[str, list[tuple[float, float, str]]] = field(default_factory=dict)  # "replica <i>" -> the
    # same, of its serving periods (requests in flight), losses and restarts

    def busy_ratios(self) -> dict[str, float]:
        return {name: t.busy_s / self.window_s for name, t in self.stages.items()} if self.window_s > 0 else {}

    def sync_totals(self) -> dict[int, float]:
        """Each version's sync s: the sum of its parts (gather and send on the train rank, the slowest
        receiver's recv, register-buffer and load)."""
        return {version: sum(parts.values()) for version, parts in self.sync.items()}


def read_timeline(path: str) -> Timeline:
    """Read a trace.json written by the pipeline (ReportError naming the file when it is not one)."""
    try:
        with open(path) as f:
            document = json.load(f)
        events = document["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ReportError(f"{path} is not a timeline the pipeline wrote (+trainer.async_trace_path): {exc}") from exc
    owners = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        raise ReportError(f"{path} holds no spans: the run recorded nothing (did it reach its first step?)")
    start = min(e["ts"] for e in spans)
    window_s = (max(e["ts"] + e["dur"] for e in spans) - start) / 1e6
    work: dict[str, list] = {}
    calls: dict[tuple[int, str, str], list] = {}  # (version, sync part, track) -> its spans
    serving: dict[str, list] = {}  # replica track -> its serving periods, losses and restarts
    stages: dict[str, StageTime] = {}
    waits: dict[tuple[str, str], list] = {}  # (stage, wait) -> its spans
    sync: dict[int, dict[str, float]] = {}
    for e in spans:
        owner, track = owners.get(e["pid"], ""), tracks.get((e["pid"], e["tid"]), "")
        if not owner.startswith(STAGE_PREFIX):
            continue
        stage = stages.setdefault(owner[len(STAGE_PREFIX):], StageTime())
        begin, seconds = e["ts"] / 1e6, e["dur"] / 1e6
        if track == "work":
            work.setdefault(owner, []).append((begin, begin + seconds, e.get("args", {}).get("index")))
            stage.items += 1
        elif track.startswith(REPLICA_PREFIX):
            serving.setdefault(track, []).append((begin, begin + seconds, f"{track}: {e['name']} {e.get('args', {})}"))
        elif e["name"] in WAITS:
            waits.setdefault((owner[len(STAGE_PREFIX):], e["name"]), []).append((begin, begin + seconds))
        part = e["name"]
        if part in SYNC_PARTS and "version" in e.get("args", {}):
            calls.setdefault((int(e["args"]["version"]), part, track), []).append((begin, begin + seconds))
    for (version, part, _), spans_of in calls.items():  # a receiver's part: its calls' union; the slowest receiver's
        parts = sync.setdefault(version, {})
        parts[part] = max(parts.get(part, 0.0), covered_s(spans_of))
    origin = start / 1e6
    lanes = {}
    for owner, spans_of in work.items():
        stage = owner[len(STAGE_PREFIX):]
        stages[stage].busy_s = covered_s((a, b) for a, b, _ in spans_of)
        lanes[stage] = [(a - origin, b - origin, f"{stage}: batch {i}" if i is not None else stage) for a, b, i in spans_of]
    for name, stage in stages.items():
        taken = [(a, b) for a, b, _ in work.get(STAGE_PREFIX + name, [])]
        stage.shares_s = {"busy": stage.busy_s}
        for wait in WAITS:
            spans_of = waits.get((name, wait), [])
            if spans_of:
                stage.waits_s[wait] = covered_s(spans_of)
            stage.shares_s[wait] = outside_s(spans_of, taken)
            taken += spans_of
        stage.shares_s["idle"] = max(0.0, window_s - sum(stage.shares_s.values()))
    replicas = {track: [(a - origin, b - origin, title) for a, b, title in spans_of]
                for track, spans_of in sorted(serving.items())}
    other = document.get("otherData", {})
    return Timeline(window_s, origin, stages, dict(sorted(sync.items())), other.get("run", {}), other.get("dropped_events", {}),
                    lanes, replicas)


@dataclass
class Metrics:
    """What the report takes from the metrics JSONL: per training step (sorted), verl's keys as logged."""

    steps: dict[int, dict]

    def series(self, key: str) -> list[tuple[int, float]]:
        return [(s, float(d[key])) for s, d in self.steps.items() if isinstance(d.get(key), (int, float))]

    def mean(self, key: str, skip: int = 1) -> Optional[float]:
        """The mean of `key` over the steps after the first `skip` (warm-up); None when never logged."""
        values = [v for s, v in self.series(key)[skip:]] or [v for _, v in self.series(key)]
        return sum(values) / len(values) if values else None

    def staleness_hist(self) -> dict[int, float]:
        """s -> the fraction of trained samples s versions old, over the run (async/staleness/hist_<s>)."""
        keys = sorted({k for d in self.steps.values() for k in d if k.startswith("async/staleness/hist_")},
                      key=lambda k: int(k.rsplit("_", 1)[1]))
        return {int(k.rsplit("_", 1)[1]): self.mean(k, skip=0) for k in keys}

    def busy_ratios(self) -> dict[str, float]:
        stages = {k.split("/")[1] for d in self.steps.values() for k in d
                  if k.startswith("async/") and k.endswith("/busy_ratio")}
        return {s: self.mean(f"async/{s}/busy_ratio") for s in sorted(stages)}


def read_metrics(path: str) -> Metrics:
    """Read verl's file-logger JSONL (rows {"step", "data"}); validation rows merge into their step."""
    steps: dict[int, dict] = {}
    try:
        lines = open(path).read().splitlines()
    except OSError as exc:
        raise ReportError(f"cannot read the metrics file {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, data = int(row["step"]), dict(row["data"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ReportError(f"{path} line {number} is not a row of verl's file logger: {exc}") from exc
        steps.setdefault(step, {}).update(data)
    return Metrics(dict(sorted(steps.items())))
