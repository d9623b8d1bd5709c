"""Faults: the demo with one fault injected per run, against an unfaulted run of the same seed.

Each run is verl's command with the flag on the demo (two CPU rollout replicas, checkpoints every
2 steps, `+trainer.max_restarts=2`, `+reward.on_error=zero`, verl's rollout dumps on), as a
subprocess in its own session. At a random step (from `--seed`) the bench injects one fault:

- `rollout_server_sigkill`: SIGKILL of one rollout server (the replica is restarted in place);
- `rollout_server_hang`: SIGSTOP of one rollout server (killed after `request_timeout_s`, restarted);
- `train_rank_sigkill`: SIGKILL of the train rank (the pipeline restarts from the newest checkpoint);
- `reward_actor_sigkill`: SIGKILL of the reward stage's actor (same; this run has a process per stage,
  `trainer.stage_processes=per_stage`, so that it kills the reward stage alone);
- `driver_sigterm`: SIGTERM of the driver (it saves a checkpoint and exits; the bench runs the
  command again and it resumes);
- `group_sigterm`: SIGTERM to every process of the run, as a scheduler stops a job (the same; the
  driver must exit within `trainer.stop_deadline_s`, 25 s, and no process of the run outlive it by 15 s);
- `reward_hangs` / `reward_raises`: the reward function hangs on / raises for one sample (scored 0).

Per run it prints: time to detect (injection -> the first log line naming the fault), time to
recover (injection -> the first training step completed after it), steps trained again, samples
lost and samples trained twice (verl's rollout dumps of the final lineage against the prompts
verl's dataloader gives each step), and the final validation reward against the unfaulted run.
Goal: every fault recovers or stops naming its cause within 30 s, no sample lost or duplicated,
no hang (a run past `--run-timeout-s` is killed and reported as hung).

    python bench/faults.py [--steps 12] [--seed 0] [--faults all] [--json bench/results/faults.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# bench/param_update.py would shadow the `param_update` package: drop this folder from the path
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.command import command_line  # noqa: E402
from async_rl.stop_signals import session_processes  # noqa: E402
TESTS = Path(__file__).resolve().parents[1] / "tests"  # the test oracle of what each step trains (tests/helpers/lineage.py)

FAULTS = ("none", "rollout_server_sigkill", "rollout_server_hang", "train_rank_sigkill", "reward_actor_sigkill",
          "driver_sigterm", "group_sigterm", "reward_hangs", "reward_raises")
STOPS = ("driver_sigterm", "group_sigterm")  # the run stops, saved; the bench starts it again to resume
STOP_DEADLINE_S = 25.0  # trainer.stop_deadline_s default
LEFT_AFTER_S = 15.0  # a stopped run's processes must be gone this long after its driver exits
VAL_KEY = "val-core/async_rl/copy_digits/reward/mean@1"
REQUEST_TIMEOUT_S = 20  # +actor_rollout_ref.rollout.request_timeout_s for the hang
REWARD_TIMEOUT_S = 5  # reward.async_timeout_s (per sample with on_error=zero)
GOAL_S = 30.0
# the first log line that names each fault (the driver's output, Ray's actor logs included)
DETECTED = {
    "rollout_server_sigkill": r"rollout replica \d+ lost \(",
    "rollout_server_hang": r"rollout replica \d+ lost \(no answer",
    "train_rank_sigkill": r"async_rl: restart \d+ of",
    "reward_actor_sigkill": r"async_rl: restart \d+ of",
    "driver_sigterm": r"SIGTERM",
    "group_sigterm": r"SIGTERM",
    "reward_hangs": r"reward function \S+ failed on",
    "reward_raises": r"reward function \S+ failed on",
}

REWARD_WITH_FAULT = """\
import os, time
from async_rl.demo.reward import compute_score as demo_score

TRIGGER, DONE, MODE = {trigger!r}, {done!r}, {mode!r}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if MODE and os.path.exists(TRIGGER) and not os.path.exists(DONE):
        open(DONE, "w").close()
        if MODE == "hang":
            time.sleep(3600)
        raise RuntimeError("injected reward failure")
    return demo_score(data_source, solution_str, ground_truth, extra_info)
"""


class Segment:
    """One process of a run: its output lines and metrics rows, each with the time it was seen."""

    def __init__(self, cmd: list[str], env: dict, workdir: Path, name: str):
        self.metrics = workdir / f"{name}.jsonl"
        self.lines: list[tuple[float, str]] = []
        self.rows: list[tuple[float, dict]] = []
        self.proc = subprocess.Popen(cmd, cwd=workdir, env={**env, "VERL_FILE_LOGGER_PATH": str(self.metrics)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self._log = open(workdir / f"{name}.log", "w")
        threading.Thread(target=self._read_output, daemon=True).start()
        threading.Thread(target=self._read_metrics, daemon=True).start()

    def _read_output(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))
            self._log.write(line)
        self._log.flush()

    def _read_metrics(self) -> None:
        seen = 0
        while True:
            done = self.proc.poll() is not None
            text = self.metrics.read_text() if self.metrics.exists() else ""
            lines = text.splitlines() if done or text.endswith("\n") else text.splitlines()[:-1]  # whole lines
            for line in lines[seen:]:
                if line.strip():
                    self.rows.append((time.monotonic(), json.loads(line)))
            seen = len(lines)
            if done:
                return
            time.sleep(0.2)

    def steps(self) -> list[tuple[float, int]]:
        return [(t, r["step"]) for t, r in self.rows if "training/global_step" in r["data"]]

    def max_step(self) -> int:
        return max((s for _, s in self.steps()), default=0)

    def processes(self) -> list[int]:
        """The pids of the run's session still alive (the driver's session: every process of the run)."""
        return session_processes(self.proc.pid)

    def kill(self) -> None:
        """SIGKILL every process of the session (the driver, Ray, every actor)."""
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def titled_processes(root_pid: int, title: str) -> list:
    """Processes under `root_pid` whose title (Ray's `ray::<Class>[.method]`) starts with `title`, oldest first."""
    import psutil

    found = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith(title):
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return sorted(found, key=lambda p: p.create_time())


def session_process(segment: Segment, title: str):
    """The newest process of the run titled `title`*."""
    found = titled_processes(segment.proc.pid, title)
    if not found:
        raise RuntimeError(f"no process titled {title}* in the run")
    return found[-1]


def inject(fault: str, segment: Segment, trigger: Path) -> None:
    if fault == "rollout_server_sigkill":
        session_process(segment, "ray::CPURolloutServer").send_signal(signal.SIGKILL)
    elif fault == "rollout_server_hang":
        session_process(segment, "ray::CPURolloutServer").send_signal(signal.SIGSTOP)
    elif fault == "train_rank_sigkill":  # the demo's only verl worker: the train rank (pi_prox on it, no ref)
        session_process(segment, "ray::PipelineWorker").send_signal(signal.SIGKILL)
    elif fault == "reward_actor_sigkill":
        session_process(segment, "ray::RewardStage").send_signal(signal.SIGKILL)
    elif fault == "driver_sigterm":
        segment.proc.send_signal(signal.SIGTERM)
    elif fault == "group_sigterm":
        os.killpg(segment.proc.pid, signal.SIGTERM)
    elif fault in ("reward_hangs", "reward_raises"):
        trigger.touch()
    else:
        raise ValueError(fault)


def lineage_counts(demo: Path, dumps: Path, steps: int) -> tuple[int, int]:
    """(samples lost, samples trained twice) of the final lineage: verl's rollout dumps against the
    prompts verl's dataloader gives steps 1..`steps`."""
    sys.path.insert(0, str(TESTS))
    from helpers.lineage import dumped_step_inputs, expected_step_inputs

    return compare_lineage(expected_step_inputs(demo, steps), dumped_step_inputs(dumps))


def compare_lineage(expected: dict, dumped: dict) -> tuple[int, int]:
    lost = sum(sum((want - dumped.get(step, type(want)())).values()) for step, want in expected.items())
    extra = sum(sum((got - expected.get(step, type(got)())).values()) for step, got in dumped.items())
    return lost, extra


def run_one(fault: str, demo: Path, workdir: Path, steps: int, inject_step: int, run_timeout_s: float) -> dict:
    """One run of the demo with `fault` injected once `inject_step` is logged; its row of the table."""
    from async_rl.demo import demo_overrides

    workdir.mkdir(parents=True)
    dumps, trigger = workdir / "dumps", workdir / "trigger"
    reward = workdir / "reward.py"
    mode = {"reward_hangs": "hang", "reward_raises": "raise"}.get(fault, "")
    reward.write_text(REWARD_WITH_FAULT.format(trigger=str(trigger), done=str(workdir / "done"), mode=mode))
    extra = {"trainer.total_training_steps": steps, "trainer.test_freq": steps, "trainer.val_before_train": False,
             "trainer.save_freq": 2, "trainer.default_local_dir": str(workdir / "ckpt"), "trainer.resume_mode": "auto",
             "trainer.rollout_data_dir": str(dumps), "reward.custom_reward_function.path": str(reward),
             "trainer.n_gpus_per_node": 4, "+trainer.use_nodes_ratios": [0.25, 0.25, 0.25, 0.5],  # 2 replicas
             "+trainer.max_restarts": 2,
             "+reward.on_error": "zero", "+reward.async_timeout_s": REWARD_TIMEOUT_S,
             "+actor_rollout_ref.rollout.request_timeout_s": REQUEST_TIMEOUT_S}
    if fault == "reward_actor_sigkill":  # the reward stage in a process of its own (the default shares one)
        extra["+trainer.stage_processes"] = "per_stage"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo, extra=extra)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    segments = [Segment(cmd, env, workdir, "run0")]
    injected_at, outcome = None, "completed"
    stop_s = procs_left = None
    while True:
        segment = segments[-1]
        if injected_at is None and fault != "none" and segment.max_step() >= inject_step:
            inject(fault, segment, trigger)
            injected_at = time.monotonic()
        code = segment.proc.poll()
        if code is not None:
            time.sleep(0.5)  # the reader threads take the last lines
            if fault in STOPS and len(segments) == 1 and injected_at is not None:
                stop_s = time.monotonic() - injected_at
                deadline = time.monotonic() + LEFT_AFTER_S
                while segment.processes() and time.monotonic() < deadline:
                    time.sleep(0.2)
                procs_left = len(segment.processes())
                segment.kill()
                segments.append(Segment(cmd, env, workdir, "run1"))  # resumes from its checkpoint
                continue
            outcome = "completed" if code == 0 else f"failed (exit {code})"
            break
        if time.monotonic() - start > run_timeout_s:
            for s in segments:
                s.kill()
            outcome = f"hung (killed after {run_timeout_s:g} s)"
            break
        time.sleep(0.2)
    lines = [item for s in segments for item in s.lines]
    step_times = [item for s in segments for item in s.steps()]
    detect_s = recover_s = None
    if injected_at is not None:
        pattern = re.compile(DETECTED[fault])
        seen = [t for t, line in lines if t >= injected_at and pattern.search(line)]
        detect_s = seen[0] - injected_at if seen else None
        # recovered: the first step after the fault was handled (for the SIGTERM, by the resumed run)
        resumed = [item for s in segments[1:] for item in s.steps()] if fault in STOPS else step_times
        after = [t for t, _ in resumed if seen and t > seen[0]]
        recover_s = after[0] - injected_at if after else None
    logged = [s for _, s in step_times]
    lost, twice = lineage_counts(demo, dumps, steps)
    val = [r["data"][VAL_KEY] for s in segments for _, r in s.rows if VAL_KEY in r["data"]]
    final = [r["data"] for s in segments for _, r in s.rows if "training/global_step" in r["data"]]
    return {
        "fault": fault,
        "inject_step": inject_step if injected_at is not None else None,
        "outcome": outcome,
        "detect_s": detect_s,
        "recover_s": recover_s,
        "steps_redone": len(logged) - len(set(logged)),
        "steps_missing": len(set(range(1, steps + 1)) - set(logged)),
        "samples_lost": lost,
        "samples_twice": twice,
        "final_val": val[-1] if val else None,
        "replica_restarts": final[-1].get("async/faults/replica_restarts") if final else None,
        "reward_errors": sum(r.get("async/faults/reward_errors", 0.0) for r in final),
        "stop_s": stop_s,  # a stop signal: injection -> the driver's exit
        "procs_left": procs_left,  # ... and the run's processes alive LEFT_AFTER_S after it
        "wall_s": time.monotonic() - start,
        "log": str(workdir / "run0.log"),
    }


def verdict(row: dict) -> str:
    if row["fault"] == "none":
        return "ok" if row["outcome"] == "completed" and not row["samples_lost"] and not row["samples_twice"] else "FAIL"
    ok = (row["outcome"] == "completed" and row["detect_s"] is not None and row["detect_s"] <= GOAL_S
          and not row["samples_lost"] and not row["samples_twice"] and not row["steps_missing"])
    if row["fault"] in STOPS:  # stopped within the deadline, nothing of the run left behind
        ok = ok and row.get("stop_s") is not None and row["stop_s"] <= STOP_DEADLINE_S and row.get("procs_left") == 0
    return "ok" if ok else "FAIL"


def format_table(rows: list[dict]) -> str:
    def num(value, fmt="{:.1f}"):
        return "-" if value is None else fmt.format(value)

    head = (f"{'fault':<22} {'step':>4} {'outcome':<10} {'detect s':>8} {'recover s':>9} {'redone':>6} "
            f"{'missing':>7} {'lost':>4} {'twice':>5} {'val':>5} {'vs none':>7} {'stop s':>6} {'left':>4}  goal")
    base = next((r["final_val"] for r in rows if r["fault"] == "none"), None)
    out = [head, "-" * len(head)]
    for r in rows:
        diff = None if base is None or r["final_val"] is None else r["final_val"] - base
        out.append(f"{r['fault']:<22} {num(r['inject_step'], '{}'):>4} {r['outcome'][:10]:<10} {num(r['detect_s']):>8} "
                   f"{num(r['recover_s']):>9} {r['steps_redone']:>6} {r['steps_missing']:>7} {r['samples_lost']:>4} "
                   f"{r['samples_twice']:>5} "
                   f"{num(r['final_val'], '{:.2f}'):>5} {num(diff, '{:+.2f}'):>7} {num(r.get('stop_s')):>6} "
                   f"{num(r.get('procs_left'), '{}'):>4}  {verdict(r)}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0, help="picks each fault's step")
    parser.add_argument("--faults", default="all", help=f"comma-separated, of {', '.join(FAULTS)}; or all")
    parser.add_argument("--run-timeout-s", type=float, default=900.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep", default=None, help="keep each run's logs, metrics and dumps under this folder")
    args = parser.parse_args(argv)
    faults = FAULTS if args.faults == "all" else tuple(args.faults.split(","))
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {list(FAULTS)}")
    if args.steps < 6:
        parser.error("--steps must be at least 6 (faults land between step 3 and steps - 3)")
    from async_rl.demo import prepare

    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="faults_") as tmp:
        tmp = args.keep or tmp
        demo = Path(tmp) / "demo"
        prepare(demo, seed=0)
        for fault in faults:
            step = rng.randint(3, args.steps - 3)
            print(f"--- {fault} (at step {step})", flush=True)
            rows.append(run_one(fault, demo, Path(tmp) / fault, args.steps, step, args.run_timeout_s))
            print(json.dumps(rows[-1]), flush=True)
    table = format_table(rows)
    command = command_line(sys.argv if argv is None else ["bench/faults.py", *argv])
    print(table)
    print(f"command: {command}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    return 0 if all(verdict(r) == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
