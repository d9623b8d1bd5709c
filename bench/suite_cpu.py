"""Where a command's CPU goes, by kind of process: run it (the test suite: `bash .ci/run`) and sample
every process on the machine every `--every-s` seconds.

Per process started after the command: its label (Ray's process title without the method, `ray::StageHost`;
`python -m <module>`, `python <script>` past Python's options; the program's name), its CPU seconds (user + system) at its last sample and its
life (s, first to last sample). Printed per label: processes, CPU-s in all, CPU-s per process, share of
the machine's busy CPU over the run (`/proc/stat`); then the run's wall, its busy CPU against what the
cores could give, and how much of it the samples saw (a process's CPU after its last sample, and
processes that live less than one interval, are not seen).

    python bench/suite_cpu.py [--every-s 2] [--json bench/results/suite_cpu.json] -- bash .ci/run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line  # noqa: E402
from bench.soak import process_name  # noqa: E402

IDLE = "ray::IDLE"  # a pooled Ray worker before it runs anything: labelled by what it becomes


@dataclass
class Seen:
    """One process as the samples saw it: label, CPU seconds at its last sample, first and last sample (s)."""
    label: str
    cpu_s: float
    first_s: float
    last_s: float


def sample(seen: dict[tuple[int, float], Seen], since: float, now: float) -> None:
    """Update `seen` (keyed by pid and start time) with every process created after `since` (epoch s), this
    one excepted."""
    import psutil

    for proc in psutil.process_iter(["create_time"]):
        try:
            created = proc.info["create_time"]
            if created < since or proc.pid == os.getpid():
                continue
            times = proc.cpu_times()
            label = process_name(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        key = (proc.pid, created)
        cpu = times.user + times.system
        if key not in seen:
            seen[key] = Seen(label, cpu, now, now)
            continue
        entry = seen[key]
        entry.cpu_s, entry.last_s = cpu, now
        if label not in ("?", IDLE):
            entry.label = label


def busy_cpu_s() -> float:
    """The machine's busy CPU seconds since boot, all cores (`/proc/stat`: all but idle and iowait)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def by_label(seen: dict, busy_s: float) -> list[dict]:
    """One row per label, most CPU first: processes, CPU-s, CPU-s per process, share of `busy_s`, mean life (s)."""
    groups: dict[str, list[Seen]] = {}
    for entry in seen.values():
        groups.setdefault(entry.label, []).append(entry)
    rows = []
    for label, es in groups.items():
        cpu_s = sum(e.cpu_s for e in es)
        rows.append({"label": label, "processes": len(es), "cpu_s": cpu_s, "cpu_s_per_process": cpu_s / len(es),
                     "share": cpu_s / busy_s if busy_s else 0.0,
                     "mean_life_s": sum(e.last_s - e.first_s for e in es) / len(es)})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every-s", type=float, default=2.0)
    parser.add_argument("--json")
    parser.add_argument("--top", type=int, default=25, help="labels printed (all go to --json)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    since, start, busy_0 = time.time() - 1.0, time.monotonic(), busy_cpu_s()
    seen: dict[tuple[int, float], Seen] = {}
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, since, time.monotonic() - start)
        time.sleep(args.every_s)
    wall, busy = time.monotonic() - start, busy_cpu_s() - busy_0
    rows = by_label(seen, busy)
    cores = os.cpu_count() or 1
    seen_cpu = sum(r["cpu_s"] for r in rows)
    print(f"{'label':<48} {'procs':>6} {'CPU-s':>8} {'s/proc':>7} {'share':>6} {'life s':>7}")
    for r in rows[:args.top]:
        print(f"{r['label'][:48]:<48} {r['processes']:>6} {r['cpu_s']:>8.0f} {r['cpu_s_per_process']:>7.1f} "
              f"{r['share']:>6.1%} {r['mean_life_s']:>7.0f}")
    print(f"exit {proc.returncode}; wall {wall:.0f} s; busy CPU {busy:.0f} s of the {cores} cores' {cores * wall:.0f} "
          f"({busy / (cores * wall):.0%}); the samples saw {seen_cpu:.0f} s of it ({seen_cpu / busy:.0%}) "
          f"in {len(seen)} processes")
    result = {"command": command_line(None if argv is None else ["bench/suite_cpu.py", *argv]),
              "exit": proc.returncode, "wall_s": wall, "busy_cpu_s": busy, "cores": cores, "seen_cpu_s": seen_cpu,
              "processes": len(seen), "labels": rows}
    print(f"command: {result['command']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(main()["exit"])
