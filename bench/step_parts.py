"""Where every second of a training step goes: verl's synchronous trainer and this pipeline, on the demo.

Runs each system on the demo (`--task copy`, the lookup agent `--task lookup`, or the long-tail task `--task long`
with `--model-size small`, as bench/e2e.py runs them) for `--steps`
steps without validation, and measures every step with two instruments at once:

- spans: the start and end of verl's own step timers (`timing_s/*`), of the functions inside them
  (the replay buffer's polls, the agent loop of every sample, every model request, every
  engine forward) and of the pipeline's stages, on one monotonic clock in every process
  (`bench/step_probe.py`, loaded by a `sitecustomize` only in the runs this script starts);
- CPU: every process of the run and the whole machine, read from /proc every `--sample-ms`.

Then it splits the mean step (steps after `--warmup`) into named parts that sum to it. verl's
synchronous step is a sequence of phases, each a span of the trainer process; the phase in which
the batch is generated runs many processes at once, and its time is split by what the machine's
cores did meanwhile: each process's share of the cores (its CPU seconds over the cores' capacity,
in seconds of the phase), the rest of the machine's load, and idle cores. The pipeline's train rank
step is split the same way into its own phases; its generate stage runs beside it and is reported
as the same shares over its busy time.

    python bench/step_parts.py [--task copy|lookup|long] [--model-size tiny|small]
        [--systems verl-sync,pipeline-k1,pipeline-k2] [--steps 25] [--warmup 5] [--json PATH]

Prints, per system, the parts (s per step and share), their sum against the measured step, the
command and the commit.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import e2e  # noqa: E402
from bench.command import command_line  # noqa: E402

FLAG_OFF = {"+actor_rollout_ref.async_pipeline": False}
ADMISSION_WINDOW = e2e.ADMISSION_WINDOW  # the *-window systems' value: --admission-window-ms
ONE_REPLICA_ON_2_RANKS = {**FLAG_OFF, "actor_rollout_ref.rollout.tensor_model_parallel_size": 2}
SYSTEMS = {  # name -> (verl's entry module, overrides on the demo's; `steps` is filled in)
    "verl-sync": (e2e.VERL_MAIN, FLAG_OFF),
    # verl's legacy synchronous trainer (main_ppo_v0: no TransferQueue, no replay buffer), deprecated in 0.9.1
    "verl-sync-v0": (e2e.VERL_MAIN, {**FLAG_OFF, "trainer.use_v1": False}),
    "verl-sync-tp2": (e2e.VERL_MAIN, ONE_REPLICA_ON_2_RANKS),
    "verl-sync-aw2": (e2e.VERL_MAIN, {**FLAG_OFF, "actor_rollout_ref.rollout.agent.num_workers": 2}),
    "pipeline-k1": (e2e.VERL_MAIN, {"+trainer.generate_ahead_steps": 1}),
    "pipeline-k2": (e2e.VERL_MAIN, {"+trainer.generate_ahead_steps": 2}),
    # vLLM's CPU build (run this script with the vllm venv's python): verl's fully_async_policy as bench/e2e.py
    # runs it, and the pipeline on the same servers
    "verl-fully-async": (e2e.FULLY_ASYNC_MAIN, {**e2e.VLLM_ON_CPU, "FULLY_ASYNC": True}),
    "pipeline-k2-vllm": (e2e.VERL_MAIN, {**e2e.VLLM_ON_CPU, "+trainer.generate_ahead_steps": 2}),
    # the pipeline on 2 train ranks and 1 rollout server (bench/e2e.py --train-ranks 2), the long task's tuned split
    "pipeline-k2-train2": (e2e.VERL_MAIN, {"+trainer.generate_ahead_steps": 2, **e2e.train_split(2)}),
    # the CPU engine's admission window (async_rl/rollout/cpu/options.py) on verl's trainer and on the pipeline
    "verl-sync-window": (e2e.VERL_MAIN, {**FLAG_OFF, ADMISSION_WINDOW: None}),
    "verl-sync-tp2-window": (e2e.VERL_MAIN, {**ONE_REPLICA_ON_2_RANKS, ADMISSION_WINDOW: None}),
    "pipeline-k2-window": (e2e.VERL_MAIN, {"+trainer.generate_ahead_steps": 2, ADMISSION_WINDOW: None}),
}


def windowed(system: str) -> bool:
    """`system` runs with the CPU engine's admission window (`--admission-window-ms`)."""
    return ADMISSION_WINDOW in SYSTEMS[system][1]


# loaded by every Python process of a run: the probe from this checkout, whatever code the run itself uses
# (as module `step_probe` in every process, so that Ray pickles what refers to it by reference)
SITECUSTOMIZE = """import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("step_probe", os.environ["STEP_PARTS_PROBE"])
probe = importlib.util.module_from_spec(spec)
sys.modules["step_probe"] = probe
spec.loader.exec_module(probe)
probe.install()
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count()
GOAL_UNNAMED = 0.05  # the named parts of a step sum to it within this share

# a process's kind, from its command line (Ray names its workers `ray::<actor class>`)
PROCESS_KINDS = (
    ("ray::AgentLoopWorker", "agent-loop worker"),
    ("ray::CPURolloutServer", "rollout server"),
    ("ray::RewardLoopWorker", "reward-loop worker"),
    ("ray::TransferQueue", "TransferQueue"),
    ("ray::SimpleStorageUnit", "TransferQueue"),
    ("ray::GlobalRequestLoadBalancer", "load balancer"),
    ("ray::WorkerDict", "trainer ranks"),
    ("ray::TaskRunner", "trainer driver"),
    ("verl.trainer.main_ppo", "driver"),
    ("py-spy record", "py-spy (this bench's profiler)"),
    ("ray::StageHost", "pipeline stages"),
    ("ray::vLLMHttpServer", "vLLM server"),
    ("EngineCore", "vLLM engine"),
    ("VLLM::Worker", "vLLM worker"),
    ("ray::FullyAsyncTrainer", "trainer driver"),
    ("ray::FullyAsyncRollouter", "fully_async rollouter"),
    ("ray::PipelineWorker", "trainer ranks"),
)
RAY_OWN = ("ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent")


def process_kind(cmdline: str) -> str:
    for prefix, kind in PROCESS_KINDS:
        if prefix in cmdline:
            return kind
    if cmdline.startswith("ray::") and not cmdline.startswith(RAY_OWN):
        return cmdline.split()[0][5:]  # another actor: its class
    return "Ray's own processes"  # gcs_server, raylet, dashboard, log monitor, idle workers


class ProcSampler:
    """Samples, every `period_s`, the CPU seconds of every process of session `sid` and the machine's busy
    and idle seconds (/proc/stat), on the monotonic clock the spans use."""

    def __init__(self, sid: int, period_s: float):
        self.sid, self.period_s = sid, period_s
        self.times: list[float] = []
        self.machine: list[tuple[float, float]] = []  # (busy s, idle s), cumulative
        self.cpu: dict[int, list[tuple[int, float]]] = defaultdict(list)  # pid -> (sample index, cumulative s)
        self.cmdlines: dict[int, str] = {}
        self.extra: set[int] = set()  # processes outside the session to sample too (this bench's py-spy)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=10)

    def _pids(self) -> list[int]:
        """The session's processes, their command lines read again (Ray renames a worker once it holds an
        actor; a process on its way out reads as empty and keeps its last name)."""
        from async_rl.stop_signals import session_processes

        pids = session_processes(self.sid) + sorted(self.extra)
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            if cmdline:
                self.cmdlines[pid] = cmdline
        return pids

    def _run(self):
        pids, refreshed = [], 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - refreshed > 1.0:
                pids, refreshed = self._pids(), now
            busy, every = e2e.machine_cpu_s()
            index = len(self.times)
            self.times.append(time.monotonic())
            self.machine.append((busy, every - busy))
            for pid in pids:
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                parts = stat[stat.rindex(")") + 2:].split()
                self.cpu[pid].append((index, (int(parts[11]) + int(parts[12])) / CLK_TCK))
            self._stop.wait(self.period_s)

    def dump(self) -> dict:
        return {"times": self.times, "machine": self.machine, "cpu": {str(k): v for k, v in self.cpu.items()},
                "cmdlines": {str(k): v for k, v in self.cmdlines.items()}, "ncpu": os.cpu_count()}


class PySpies:
    """`py-spy record` (raw stacks, 100 Hz, the process not paused) on every process of the given kinds, from
    `start` until `stop` (SIGINT: py-spy writes what it has)."""

    def __init__(self, sampler: ProcSampler, kinds: set[str], out: Path):
        self.sampler, self.kinds, self.out = sampler, kinds, out
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        spy = Path(sys.executable).with_name("py-spy")
        for pid, cmdline in list(self.sampler.cmdlines.items()):
            if process_kind(cmdline) in self.kinds:
                self.procs.append(subprocess.Popen(
                    [str(spy), "record", "-p", str(pid), "-r", "100", "--nonblocking", "-f", "raw",
                     "-o", str(self.out / f"pyspy-{pid}.txt")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                self.sampler.extra.add(self.procs[-1].pid)  # its CPU is the bench's, not the machine's other load

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def code_at(ref: str, raw: Path) -> Path:
    """This repository's files at git `ref`, extracted once under `raw` (`git archive`): a run with them first on
    PYTHONPATH runs that commit's code (the package's editable install comes after PYTHONPATH)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                            check=True, timeout=60).stdout.strip()
    folder = raw / f"code-{commit}"
    if not folder.exists():
        folder.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True, timeout=300)
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True, timeout=300)
    return folder


def run_system(name: str, demo_dir: Path, out: Path, steps: int, warmup: int, task: str, sample_ms: float,
               timeout_s: float, spy_kinds: set[str], extra: dict, code: Path = ROOT) -> None:
    """One run of `name` for `steps` steps with the probe, the sampler and (on `spy_kinds`' processes, from
    step `warmup` to the last) py-spy; raw data under `out`. `code`: the checkout whose package runs."""
    from async_rl.demo import demo_overrides

    out.mkdir(parents=True, exist_ok=True)
    spans = out / "spans"
    spans.mkdir(exist_ok=True)
    site = out / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    metrics = out / "metrics.jsonl"
    main, system = SYSTEMS[name]
    system = dict(system)
    if system.pop("FULLY_ASYNC", False):
        from async_rl.demo.task import TRAIN_BATCH_SIZE

        system.update(e2e.fully_async_overrides(steps, TRAIN_BATCH_SIZE))
    settings = {"trainer.total_training_steps": steps, "trainer.val_before_train": False, "trainer.test_freq": -1,
                **system, **extra}
    overrides = demo_overrides(demo_dir, extra=settings, agent=task == "lookup", long=task == "long")
    if main == e2e.FULLY_ASYNC_MAIN:
        overrides = [o for o in overrides if not o.startswith(e2e.PIPELINE_KEYS)]
    (out / "overrides.json").write_text(json.dumps(overrides))
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics), "PYTHONUNBUFFERED": "1", "STEP_PARTS_DIR": str(spans),
           "STEP_PARTS_PROBE": str(ROOT / "bench" / "step_probe.py"),
           "PYTHONPATH": os.pathsep.join([str(site), str(code), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", main, *overrides], cwd=out, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = ProcSampler(proc.pid, sample_ms / 1000).start()
        spies = PySpies(sampler, spy_kinds, out)
        spying = False
        start = time.monotonic()
        try:
            while proc.poll() is None and time.monotonic() - start < timeout_s:
                done = e2e.steps_logged(metrics)
                if spy_kinds and not spying and done >= warmup:
                    spies.start()
                    spying = True
                if spying and done >= steps - 1:
                    spies.stop()
                time.sleep(0.5)
        finally:
            spies.stop()
            sampler.stop()
            if proc.poll() is None:
                from bench.e2e import stop_like_a_scheduler

                stop_like_a_scheduler(proc)
    (out / "cpu.json").write_text(json.dumps(sampler.dump()))
    if proc.returncode != 0:
        raise RuntimeError(f"{name} exited with {proc.returncode}: {(out / 'log.txt').read_text()[-3000:]}")


# ------------------------------------------------------------------------------------------- analysis


def load_spans(out: Path) -> dict[int, list[tuple]]:
    """pid -> [(name, start, end, cpu, extra)]."""
    spans = {}
    for path in (out / "spans").glob("spans-*.jsonl"):
        pid = int(path.stem.split("-")[1])
        spans[pid] = [tuple(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return spans


def process_kinds(out: Path, cmdlines: dict) -> dict[int, str]:
    """pid -> kind: a kind of PROCESS_KINDS its command line names, else Ray's `ray::<class>`, else the name its
    lines carry in the run's log (`(<class> pid=N)`)."""
    import re

    named = {int(m.group(2)): m.group(1) for m in re.finditer(r"\((\w+) pid=(\d+)\)", (out / "log.txt").read_text())}
    kinds = {}
    for pid, cmdline in cmdlines.items():
        pid = int(pid)
        known = any(prefix in cmdline for prefix, _ in PROCESS_KINDS)
        by_log = not known and not cmdline.startswith("ray::") and pid in named
        kinds[pid] = process_kind(f"ray::{named[pid]}" if by_log else cmdline)
    return kinds


class CpuTimeline:
    """CPU seconds of each process and the machine's busy / idle seconds over any window (ProcSampler's samples)."""

    def __init__(self, data: dict, kinds: dict[int, str]):
        self.times = data["times"]
        self.ncpu = data["ncpu"]
        self.per_pid = {int(pid): ([self.times[i] for i, _ in series], [v for _, v in series])
                        for pid, series in data["cpu"].items() if series}
        self.kinds = kinds
        self.busy = (self.times, [busy for busy, _ in data["machine"]])
        self.idle = (self.times, [idle for _, idle in data["machine"]])

    @staticmethod
    def _at(series: tuple[list[float], list[float]], t: float) -> float:
        """A cumulative series at time t, linearly interpolated (flat outside its samples)."""
        ts, vs = series
        j = bisect.bisect_left(ts, t)
        if j == 0:
            return vs[0]
        if j >= len(ts):
            return vs[-1]
        t0, t1 = ts[j - 1], ts[j]
        return vs[j - 1] + (vs[j] - vs[j - 1]) * (t - t0) / (t1 - t0) if t1 > t0 else vs[j]

    def pid_cpu(self, pid: int, a: float, b: float) -> float:
        series = self.per_pid.get(pid)
        return max(self._at(series, b) - self._at(series, a), 0.0) if series else 0.0

    def window(self, a: float, b: float) -> dict[str, float]:
        """Core-seconds in [a, b] by process kind, `other processes on the machine` (the machine's busy time
        outside this run) and `idle cores`."""
        out: dict[str, float] = defaultdict(float)
        for pid in self.per_pid:
            out[self.kinds.get(pid, "?")] += self.pid_cpu(pid, a, b)
        busy = self._at(self.busy, b) - self._at(self.busy, a)
        out["other processes on the machine"] = max(busy - sum(out.values()), 0.0)
        out["idle cores"] = max(self._at(self.idle, b) - self._at(self.idle, a), 0.0)
        return dict(out)


# py-spy stacks -> named groups, per process kind: the first pattern found in a stack names it
SPY_GROUPS = {
    "agent-loop worker": (
        ("transfer_queue/", "TransferQueue reads and writes"),
        ("hydra/_internal/instantiate", "building each sample's agent loop (hydra instantiate)"),
        ("_compute_score", "the reward request"),
        ("LLMServerClient", "the model request (load balancer, server call)"),
        ("tokeniz", "tokenizing the prompt"),
        ("_agent_loop_postprocess", "post-processing the output"),
        ("_run_agent_loop", "the agent loop's own code"),
        ("serializ", "Ray (de)serialization"),
        ("ray/", "Ray's event loop and calls"),
    ),
    "rollout server": (
        ("decode_forward", "engine decode forwards"),
        ("prefill_forward", "engine prefill forwards"),
        ("sample_tokens", "engine sampling"),
        ("kv_batch.py", "engine batch bookkeeping"),
        ("_step", "engine step loop"),
        ("server.py", "request handling (server.generate)"),
        ("engine.py", "request handling (engine.generate)"),
        ("serializ", "Ray (de)serialization"),
        ("ray/", "Ray's event loop and calls"),
    ),
}
SPY_GROUPS["trainer ranks"] = (
    ("torch/distributed", "collectives (gloo)"),
    ("autograd", "backward"),
    ("optim", "optimizer step"),
    ("forward (", "model forward"),
    ("tensordict", "data movement (TensorDict)"),
    ("protocol.py", "data movement (DataProto)"),
    ("serializ", "Ray (de)serialization"),
    ("ray/", "Ray's event loop and calls"),
)
SPY_GROUPS["pipeline stages"] = (
    ("agent_loop", "agent loops (verl's AgentLoopWorker code)"),
    ("rollout/requests.py", "model requests (generate_resumable)"),
    ("actor_train.py", "train stage"),
    ("reward", "reward stage"),
    ("param_update", "weight sync stage"),
    ("serializ", "Ray (de)serialization"),
    ("ray/", "Ray's event loop and calls"),
)
IDLE_LEAVES = ("Worker.main_loop", "select (selectors", "EpollSelector.select", "wait (threading", "_worker (concurrent")


def spy_lines(text: str) -> list[str]:
    """A py-spy raw profile's lines, "stack count" each; a stack whose frame name holds a line break (a
    frame of an asyncio task can show its repr) is joined back into one line."""
    lines, pending = [], ""
    for line in text.splitlines():
        pending += line
        if pending.rpartition(" ")[2].isdigit():
            lines.append(pending)
            pending = ""
    return lines


def spy_groups(path: Path, kind: str) -> dict[str, float]:
    """Share of a py-spy raw profile's busy samples per group of SPY_GROUPS[kind] (leaves that block are left out)."""
    counts: dict[str, float] = defaultdict(float)
    for line in spy_lines(path.read_text()):
        stack, _, count = line.rpartition(" ")
        if not stack or any(leaf in stack.rsplit(";", 1)[-1] for leaf in IDLE_LEAVES):
            continue
        group = next((name for pattern, name in SPY_GROUPS.get(kind, ()) if pattern in stack), "other code")
        counts[group] += int(count)
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total else {}


def span_sum(spans: list[tuple], name: str, a: float, b: float, field: int = 2) -> float:
    """Seconds of `name` spans inside [a, b] (clipped): wall (field 2) or, for field 3, the spans' CPU scaled by
    the part of each span inside the window."""
    total = 0.0
    for span in spans:
        if span[0] != name or span[2] <= a or span[1] >= b:
            continue
        inside = min(span[2], b) - max(span[1], a)
        if field == 2:
            total += inside
        elif span[3] is not None and span[2] > span[1]:
            total += span[3] * inside / (span[2] - span[1])
    return total


def split_concurrent(a: float, b: float, cpu: CpuTimeline, spans: dict[int, list[tuple]],
                     spy: dict[str, dict[str, float]]) -> dict[str, float]:
    """Split the wall seconds of [a, b] by core shares: each process kind's CPU over the machine's core-seconds
    (a process busy on one of 2 cores for the whole window gets half of it), with the rollout servers' split into
    the engine's forwards (from their spans' CPU) and the rest, and a kind py-spy profiled split by its groups."""
    cores = cpu.window(a, b)
    engine = defaultdict(float)
    for pid, kind in cpu.kinds.items():
        if kind == "rollout server" and pid in spans:
            for name, label in (("engine_prefill", "engine prefill forwards"), ("engine_decode", "engine decode forwards"),
                                ("engine_sample", "engine sampling")):
                engine[label] += span_sum(spans[pid], name, a, b, field=3)
    detailed: dict[str, float] = {}
    for kind, seconds in cores.items():
        if kind == "rollout server" and engine:
            rest = max(seconds - sum(engine.values()), 0.0)
            for label, value in engine.items():
                detailed[f"rollout server: {label}"] = min(value, seconds)
            detailed["rollout server: request handling and its event loop"] = rest
        elif kind in spy:
            for group, share in spy[kind].items():
                detailed[f"{kind}: {group}"] = seconds * share
        else:
            detailed[kind] = seconds
    total = sum(detailed.values())
    return {k: (b - a) * v / total for k, v in detailed.items()} if total > 0 else {"idle cores": b - a}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping intervals merged (two batches generated at once count once)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def mean_parts(per_step: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for parts in per_step for k in parts}
    return {k: sum(p.get(k, 0.0) for p in per_step) / len(per_step) for k in keys}


SERIAL_TIMERS = (  # verl's step timers (`timing_s/<name>`) that run one after another, and their parts' names
    ("balance_batch", "balance the batch"), ("timer/reward", "reward"), ("timer/old_log_prob", "old log-prob pass"),
    ("timer/ref", "reference log-prob pass"), ("timer/values", "critic values"), ("timer/adv", "advantages"),
    ("timer/update_critic", "critic update"), ("timer/update_actor", "actor update"),
    ("timer/update_weights", "weight sync into the replicas"),
    ("timer/timing_s/param_sync", "weight sync (this package's async_rl checkpoint engine)"),
)


ROLLOUTER_CALLS = ("fully_async's calls to its rollouter around the weight sync (FullyAsyncTrainer._fit_update_weights "
                   "beyond param_sync: sample counts, reset_staleness)")
SPLIT_PHASES = ("old log-prob pass", "actor update", "critic update", "reference log-prob pass", "critic values")


def load_run(out: Path) -> tuple[CpuTimeline, dict[int, list[tuple]], dict[str, dict[str, float]], dict[int, str]]:
    """A run's CPU timeline, spans, py-spy groups per process kind and process kinds."""
    cpu_data = json.loads((out / "cpu.json").read_text())
    kinds = process_kinds(out, cpu_data["cmdlines"])
    spy = {}
    for path in out.glob("pyspy-*.txt"):
        kind = kinds.get(int(path.stem.split("-")[1]), "?")
        spy[kind] = spy_groups(path, kind)
    return CpuTimeline(cpu_data, kinds), load_spans(out), spy, kinds


def verl_parts(out: Path, warmup: int) -> dict:
    """One of verl's trainers, its step part by part (mean s per step over the steps after `warmup`): the trainer's
    phases in sequence; the phase that waits for the batch split by each process's share of the cores meanwhile.

    Synchronous trainer (V1): the batch is dispatched (`prepare_step`), generated until its last sample is in
    TransferQueue, and then found by the replay buffer's next poll. fully_async_policy: the trainer waits for
    the rollouter's samples (`gen`) while the rollouter generates beside it."""
    cpu, spans, spy, kinds = load_run(out)
    trainer = next(pid for pid, s in spans.items() if any(x[0] == "timer/step" for x in s))
    own = spans[trainer]
    loops = [s for pid, ss in spans.items() if kinds.get(pid) == "agent-loop worker" for s in ss
             if s[0] in ("agent_loop_prompt", "agent_loop_sample")]
    steps = sorted((s for s in own if s[0] == "timer/step"), key=lambda s: s[1])[warmup:]
    per_step, serial, gen_windows = [], [], []
    for _, a, b, *_ in steps:
        inside = [s for s in own if a <= s[1] and s[2] <= b + 1e-6]

        def first(name):
            return next((s for s in inside if s[0] == name), None)

        parts: dict[str, float] = {}
        prepare, sample, gen = first("prepare_step"), first("replay_buffer_sample"), first("timer/gen")
        if prepare is not None and sample is not None:  # the synchronous trainer
            gen_start = prepare[2]
            gen_done = max([s[2] for s in loops if gen_start <= s[2] <= sample[2]] + [gen_start])
            parts["dispatch the batch (prepare_step: dataloader, TransferQueue, agent-loop manager)"] = \
                prepare[2] - prepare[1]
            parts["verl's replay buffer: polling after the last sample (ReplayBuffer.sample, 2-s sleeps)"] = \
                sample[2] - gen_done
            sleep = first("sleep_replicas")
            parts["sleep_replicas"] = sleep[2] - sleep[1] if sleep else 0.0
        else:  # fully_async_policy: the trainer's wait for samples
            gen_start, gen_done = gen[1], gen[2]
        parts.update({f"generation: {k}": v for k, v in split_concurrent(gen_start, gen_done, cpu, spans, spy).items()})
        for name, label in SERIAL_TIMERS:
            span = first(name)
            if span is None:
                continue
            if label in SPLIT_PHASES:  # the trainer ranks' phases: what the cores did meanwhile
                parts.update({f"{label}: {k}": v for k, v in split_concurrent(span[1], span[2], cpu, spans, spy).items()})
            else:
                parts[label] = span[2] - span[1]
        sync_call = first("fully_async_update_weights")
        if sync_call is not None:  # fully_async_policy's calls to its rollouter around the weight sync
            sync = first("timer/timing_s/param_sync")
            parts[ROLLOUTER_CALLS] = (sync_call[2] - sync_call[1]) - (sync[2] - sync[1] if sync else 0.0)
        parts["rest of the step (unnamed)"] = (b - a) - sum(parts.values())
        per_step.append(parts)
        serial.append(b - a)
        gen_windows.append(gen_done - gen_start)
    return {"step_s": sum(serial) / len(serial), "parts": mean_parts(per_step), "steps": len(serial),
            "generation_s": sum(gen_windows) / len(gen_windows), "warmup_end": steps[0][1]}


def pipeline_parts(out: Path, warmup: int) -> dict:
    """The pipeline's train-rank step (serial parts) and its generate stage's busy time per step (core shares)."""
    cpu, spans, spy, kinds = load_run(out)
    host = next(pid for pid, s in spans.items() if any(x[0] == "train_step" for x in s))
    own = sorted(spans[host], key=lambda s: s[1])
    train = [s for s in own if s[0] == "train_step"]
    gens = [s for s in own if s[0] == "generate_batch"]
    per_step, busy_parts, steps = [], [], []
    for prev, cur in zip(train[warmup:], train[warmup + 1:]):
        a, b = prev[2], cur[2]
        parts = {"waiting for the next batch": cur[1] - a}
        for name, label in (("pi_prox", "pi_prox pass (old log-probs)"), ("update_actor", "actor update"),
                            ("send_weight_buckets", "weight gather")):
            parts[label] = span_sum(own if name != "send_weight_buckets" else
                                    [s for ss in spans.values() for s in ss if s[0] == name], name, cur[1], b)
        parts["rest of the train step (batch, metrics)"] = (b - a) - sum(parts.values())
        per_step.append(parts)
        steps.append(b - a)
        windows = union([(max(g[1], a), min(g[2], b)) for g in gens if g[2] > a and g[1] < b])
        busy = {}
        for wa, wb in windows:
            for k, v in split_concurrent(wa, wb, cpu, spans, spy).items():
                busy[k] = busy.get(k, 0.0) + v
        busy_parts.append(busy)
    return {"step_s": sum(steps) / len(steps), "parts": mean_parts(per_step), "steps": len(steps),
            "generate_busy": mean_parts(busy_parts), "warmup_end": train[warmup][2]}


OWNERS = (  # process or part name prefix -> whose code runs in it (a phase's parts: the name after "<phase>: ")
    ("rollout server", "ours"), ("pipeline stages", "ours"), ("Ray's own", "Ray"), ("other processes", "machine"),
    ("idle", "idle"), ("weight sync into the replicas", "verl+ours"), ("weight sync (this package", "ours+verl"),
    ("vLLM", "vLLM"), ("py-spy", "bench"), ("rest of", "-"),
)
PIPELINE_OWNED = ("waiting for the next batch", "pi_prox pass", "actor update", "weight gather", "rest of the train")


def owner(system: str, part: str) -> str:
    """Whose code a part runs: `ours` (this package), `verl`, `Ray`, `machine` (processes outside the run), `idle`."""
    if system.startswith("pipeline") and part.startswith(PIPELINE_OWNED):
        return "ours+verl" if part.startswith(("pi_prox", "actor update")) else "ours"
    if system.startswith("pipeline") and part == "trainer ranks":
        return "ours+verl"  # this package's worker running verl's engine
    if phase_of(part) is not None:
        part = part.split(": ", 1)[1]  # a process in any phase: the same owner
    for prefix, who in OWNERS:
        if part.startswith(prefix):
            return who
    return "verl"


def engine_facts(out: Path, warmup_end: float) -> dict:
    """Per step, after `warmup_end` (s on the monotonic clock): the engine's forwards, the rows they decoded and
    prefilled, over every rollout server; the mean response length of the run's steps; fully_async_policy: the
    mean call of its rollouter's reset_staleness (s, in the rollouter)."""
    spans = load_spans(out)
    forwards = [s for ss in spans.values() for s in ss if s[0] == "engine_forward" and s[1] >= warmup_end]
    servers = sum(any(s[0] == "engine_forward" for s in ss) for ss in spans.values())
    rows = [json.loads(line)["data"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    lengths = [r["response_length/mean"] for r in rows if "response_length/mean" in r]
    gaps = sorted(gap for ss in spans.values() for gap in arrival_gaps(ss, warmup_end))
    walls = sorted(s[2] - s[1] for s in forwards)
    resets = [s[2] - s[1] for ss in spans.values() for s in ss
              if s[0] == "rollouter_reset_staleness" and s[1] >= warmup_end]
    return {"servers": servers, "forwards": len(forwards), "decode_rows": sum(s[4]["decode_rows"] for s in forwards),
            "prefill_rows": sum(s[4]["prefill_rows"] for s in forwards),
            "response_length": sum(lengths) / len(lengths) if lengths else None,
            "arrival_gap_ms": {"p50": 1e3 * quantile(gaps, 0.5), "p90": 1e3 * quantile(gaps, 0.9)} if gaps else None,
            "forward_wall_ms": 1e3 * quantile(walls, 0.5) if walls else None,
            "reset_staleness_s": sum(resets) / len(resets) if resets else None}


def arrival_gaps(spans: list[tuple], after: float, within_s: float = 1.0) -> list[float]:
    """Seconds between consecutive requests reaching one server (its `server_generate` spans' starts) after
    `after`, the gaps longer than `within_s` (between steps) left out."""
    starts = sorted(s[1] for s in spans if s[0] == "server_generate" and s[1] >= after)
    return [b - a for a, b in zip(starts, starts[1:]) if b - a <= within_s]


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of sorted `values` (nearest rank)."""
    return values[min(len(values) - 1, int(q * len(values)))]


def analyze(name: str, out: Path, warmup: int) -> dict:
    result = verl_parts(out, warmup) if name.startswith("verl") else pipeline_parts(out, warmup)
    facts = engine_facts(out, result.pop("warmup_end"))
    steps = result["steps"]
    facts.update({k: facts[k] / steps for k in ("forwards", "decode_rows", "prefill_rows")})
    result["engine_per_step"] = facts
    result["owners"] = {}
    for part, seconds in result["parts"].items():
        who = owner(name, part)
        result["owners"][who] = result["owners"].get(who, 0.0) + seconds
    return result


def phase_of(part: str) -> str | None:
    """`generation` or one of SPLIT_PHASES for a part split by core shares ("<phase>: <process>..."), else None."""
    head = part.split(": ", 1)[0]
    return head if ": " in part and (head == "generation" or head in SPLIT_PHASES) else None


def report(name: str, result: dict) -> list[str]:
    step, parts = result["step_s"], result["parts"]
    unnamed = sum(v for k, v in parts.items() if k.startswith("rest of the step"))
    lines = [f"{name}: mean step {step:.3f} s over {result['steps']} steps; named parts {step - unnamed:.3f} s "
             f"({(step - unnamed) / step:.1%} of it)"]
    lines.append(f"  {'s/step':>7} {'share':>6}  {'code':<9} part")
    phases: dict[str, float] = {}
    for part, seconds in parts.items():
        key = phase_of(part) or part
        phases[key] = phases.get(key, 0.0) + seconds
    for phase, total in sorted(phases.items(), key=lambda kv: -kv[1]):
        subparts = {k: v for k, v in parts.items() if phase_of(k) == phase}
        if not subparts:
            if abs(total) >= 0.0005:
                lines.append(f"  {total:7.3f} {total / step:6.1%}  {owner(name, phase):<9} {phase}")
            continue
        lines.append(f"  {total:7.3f} {total / step:6.1%}  {'':<9} {phase}, by each process's share of the "
                     f"{CORES} cores meanwhile:")
        for part, seconds in sorted(subparts.items(), key=lambda kv: -kv[1]):
            if abs(seconds) >= 0.0005:
                lines.append(f"  {seconds:7.3f} {seconds / step:6.1%}  {owner(name, part):<9}   "
                             f"{part.split(': ', 1)[1]}")
    if result.get("generate_busy"):
        busy = result["generate_busy"]
        total = sum(busy.values())
        lines.append(f"  beside the step: the generate stage busy {total:.3f} s a step, by each process's share of "
                     f"the {CORES} cores meanwhile:")
        for part, seconds in sorted(busy.items(), key=lambda kv: -kv[1]):
            if seconds >= 0.0005:
                lines.append(f"  {seconds:7.3f} {seconds / total:6.1%}  {owner(name, part):<9}   {part}")
    facts = result["engine_per_step"]
    if facts["servers"]:
        lines.append(f"  engine: {facts['forwards']:.0f} forwards a step over {facts['servers']} server(s), "
                     f"{facts['decode_rows']:.0f} rows decoded and {facts['prefill_rows']:.0f} prefilled")
        if facts.get("arrival_gap_ms") and facts.get("forward_wall_ms"):
            gap = facts["arrival_gap_ms"]
            rows = (facts["decode_rows"] + facts["prefill_rows"]) / facts["forwards"]
            lines.append(f"  requests reach a server {gap['p50']:.1f} ms (median) / {gap['p90']:.1f} ms (90th percentile) "
                         f"after the one before; a forward takes {facts['forward_wall_ms']:.1f} ms (median, wall) "
                         f"for {rows:.1f} rows on average")
    if facts.get("reset_staleness_s") is not None:
        lines.append(f"  the rollouter's reset_staleness: {facts['reset_staleness_s']:.3f} s a call in the rollouter "
                     f"(its wait for the rollouter's lock included)")
    lines.append(f"  mean response: {facts['response_length']:.2f} tokens")
    lines.append("  by code: " + ", ".join(f"{who} {sec:.3f} s" for who, sec in
                                          sorted(result["owners"].items(), key=lambda kv: -kv[1])))
    within = abs(unnamed) <= GOAL_UNNAMED * step
    lines.append(f"  goal: the named parts within {GOAL_UNNAMED:.0%} of the step: {'met' if within else 'missed'} "
                 f"({abs(unnamed) / step:.1%} unnamed)")
    return lines


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=("copy", "lookup", "long"), default="copy")
    parser.add_argument("--model-size", default="tiny",
                        help="the demo model's size, a row of async_rl.demo.task.MODEL_SIZES (--task long: small)")
    parser.add_argument("--systems", default="verl-sync,pipeline-k1,pipeline-k2",
                        help=f"of {', '.join(SYSTEMS)}; NAME@REF runs NAME with this repository's code at git REF")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the means")
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=1500.0, help="most seconds one run takes")
    parser.add_argument("--raw-dir", help="keep each run's raw spans, CPU samples and log here")
    parser.add_argument("--reuse", action="store_true", help="analyze the runs already in --raw-dir")
    parser.add_argument("--py-spy", default="agent-loop worker,rollout server,pipeline stages,trainer ranks",
                        help="process kinds to profile with py-spy from --warmup on ('' for none)")
    parser.add_argument("--admission-window-ms", type=float, default=30.0,
                        help="the CPU engine's admission window of the *-window systems")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.reuse and not args.raw_dir:
        parser.error("--reuse reads the runs in --raw-dir: give it")
    from async_rl.demo.task import MODEL_SIZES, covers_long_task

    if args.model_size not in MODEL_SIZES:
        parser.error(f"--model-size {args.model_size}: one of {', '.join(MODEL_SIZES)}")
    if args.task == "long" and not covers_long_task(args.model_size):
        parser.error(f"--task long needs a model whose positions hold its responses: --model-size "
                     f"{' or '.join(s for s in MODEL_SIZES if covers_long_task(s))}")
    names = [n for n in args.systems.split(",") if n]
    unknown = [n for n in names if n.partition("@")[0] not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}: choose from {list(SYSTEMS)}")
    command = command_line()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(args.raw_dir or tmp).resolve()
        for name in names:
            system, _, ref = name.partition("@")
            out = raw / f"{args.task}_{name.replace('@', '_at_').replace('/', '_')}"
            if not (args.reuse and (out / "cpu.json").exists()):
                demo = raw / "demo"
                if not demo.exists():
                    from async_rl.demo import prepare

                    prepare(demo, seed=0, model_size=args.model_size)
                window = {ADMISSION_WINDOW: args.admission_window_ms} if windowed(system) else {}
                run_system(system, demo, out, args.steps, args.warmup, args.task, args.sample_ms, args.timeout_s,
                           set(filter(None, args.py_spy.split(","))), window, code_at(ref, raw) if ref else ROOT)
            results[name] = analyze(system, out, args.warmup)
    lines = [f"command: {command}",
             f"cpus: {CORES}; task {args.task}; model {args.model_size}; {args.steps} steps a run, the first "
             f"{args.warmup} left out; CPU "
             f"sampled every {args.sample_ms:g} ms; py-spy on: {args.py_spy or 'none'}"
             + (f"; the CPU engine's admission window {args.admission_window_ms:g} ms in the *-window systems"
                if any(windowed(n.partition("@")[0]) for n in names) else "")]
    for name in names:
        lines += [""] + report(name, results[name])
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "cpus": CORES, "task": args.task,
                                               "systems": results}, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
