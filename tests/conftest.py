"""Shared fixtures: the demo task built once per session, one Ray cluster for the tests that can share it,
and running verl's command on the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from async_rl.stop_signals import session_processes
from helpers.lineage import compose_ppo, dumped_step_inputs, expected_step_inputs, read_jsonl  # noqa: F401 - tests import them from here

# Every Ray the tests start (their own, verl's, the shared clusters) skips Ray's prestart of one idle
# Python worker per logical CPU when the first driver connects: 1.7-2.6 s of CPU each on these 2 cores,
# for workers the runs' actors never use (their processes start on demand).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# Ray's log monitor looks for new worker log files 10 times a second, a glob and a stat of every file of the
# session: with 600 files (a suite's cluster collects hundreds), 8.9% of a core against 2.7% looking once a
# second (Ray's LogMonitor run for 15 s on 600 empty worker log files, each way, on this 2-core machine). A
# new worker's output reaches the driver up to a second later; nothing is lost.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
os.environ.setdefault("LOG_NAME_UPDATE_INTERVAL_S", "1")

# A hang guard for one Ray call in a test, not a performance bound: a new actor's first answer includes its
# process start and imports, which can take over 60 s on 2 cores saturated by the test lanes.
RAY_CALL_GUARD_S = 300


RAY_FIXTURES = {"ray_address", "ray_cluster", "small_objects_ray_address", "small_objects_ray"}
FAST_LANE_LEAVES_OUT = ("e2e", "bench")  # folders of end-to-end runs and bench scripts run as commands


_SESSION_EXIT: dict[str, int] = {}  # pytest's exit status, kept for the way out


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _SESSION_EXIT["status"] = int(session.exitstatus)  # as pytest returns it, after every other hook


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Once every result is reported (summary, durations): Ray disconnected, then out with pytest's exit status
    without the interpreter's teardown, where a native library's thread (Ray's core worker, torch's and
    gloo's pools) can take the process down with SIGSEGV after a run whose results are all written."""
    if "status" not in _SESSION_EXIT:
        return
    if ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_SESSION_EXIT["status"])


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast lane (scripts/test.sh --fast): no Ray start, no end-to-end run, no bench script")


def pytest_collection_modifyitems(config, items):
    """The fast lane leaves out the tests of e2e/ and bench/, those marked slow, vllm, sglang or ray, and those on a Ray
    fixture."""
    if not config.getoption("--fast"):
        return
    def left_out(item) -> bool:
        return (Path(str(item.fspath)).parent.name in FAST_LANE_LEAVES_OUT
                or any(item.get_closest_marker(m) for m in ("slow", "vllm", "sglang", "ray"))
                or bool(RAY_FIXTURES & set(getattr(item, "fixturenames", ()))))
    config.hook.pytest_deselected(items=[i for i in items if left_out(i)])
    items[:] = [i for i in items if not left_out(i)]


@pytest.fixture(autouse=True)
def no_ray_in_the_fast_lane(request, monkeypatch):
    """In the fast lane a test that starts or joins Ray fails, naming the marker it needs: in this process
    (Ray's node), or in a child (RAY_ADDRESS is no address)."""
    if not request.config.getoption("--fast"):
        yield
        return
    import ray._private.node

    def refuse(*_, **__):
        raise AssertionError(f"{request.node.nodeid} starts Ray: mark it @pytest.mark.ray (the fast lane starts none)")

    monkeypatch.setattr(ray._private.node.Node, "__init__", refuse)
    monkeypatch.setenv("RAY_ADDRESS", "the-fast-lane-starts-no-ray")  # a child's ray.init() fails at once, naming it
    yield


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    """A prepared demo (tiny model, tokenizer, data, reward.py, overrides.txt)."""
    from async_rl.demo import prepare

    root = tmp_path_factory.mktemp("demo")
    prepare(root, seed=0, train_size=1024, val_size=32)
    return root


def start_cluster(**system_config):
    """A one-node Ray cluster (`ray.cluster_utils.Cluster`): 32 logical CPUs (stages mostly wait), 8 logical
    GPUs (verl's trainer and vLLM's CPU build count devices as GPUs), a 2 GiB object store, no dashboard."""
    from ray._common.utils import reset_ray_address
    from ray.cluster_utils import Cluster

    from async_rl.pipeline import retry_ray_start

    args = {"num_cpus": 32, "num_gpus": 8, "include_dashboard": False, "object_store_memory": 2 << 30}
    if system_config:
        args["_system_config"] = system_config
    cluster = retry_ray_start(lambda: Cluster(initialize_head=True, head_node_args=args))  # Ray's 30 s, on a loaded machine
    reset_ray_address()  # Cluster advertises itself to every later `ray.init()` on this machine
    return cluster


@pytest.fixture(scope="session")
def ray_address():
    """The address of the session's Ray cluster, started at its first use and shared by every test that
    can share it: a test connects its own driver to it (`ray_cluster`), verl's command joins it through
    RAY_ADDRESS (`run_verl(..., ray_address=...)`). A test that kills every process of a run starts its own."""
    cluster = start_cluster()
    yield cluster.address
    cluster.shutdown()


@pytest.fixture
def ray_cluster(ray_address, request):
    """This test's driver on the session's cluster (its test module's folder on the workers' path); the
    test's actors go with the driver at its end."""
    ray.init(address=ray_address, runtime_env={"env_vars": {"PYTHONPATH": str(request.path.parent)}})
    yield ray_address
    ray.shutdown()


@pytest.fixture(scope="session")
def small_objects_ray_address():
    """A second session cluster, for the weight-sync tests: objects over 1 KiB go to the object store (Ray
    inlines smaller ones), as real buckets do, with the tests' tiny models."""
    cluster = start_cluster(max_direct_call_object_size=1024)
    yield cluster.address
    cluster.shutdown()


@pytest.fixture
def small_objects_ray(small_objects_ray_address, request):
    """This test's driver on the small-objects cluster (as `ray_cluster`)."""
    ray.init(address=small_objects_ray_address, runtime_env={"env_vars": {"PYTHONPATH": str(request.path.parent)}})
    yield small_objects_ray_address
    ray.shutdown()


def run_verl(demo_dir: Path, extra, workdir: Path, timeout_s: float = 600, critic: bool = False,
             ray_address: str | None = None, agent: bool = False) -> tuple[int, str, list[dict]]:
    """`python -m verl.trainer.main_ppo <demo overrides + extra>` (`critic`: the demo's PPO with GAE; `agent`:
    the lookup task's agent loop), on the Ray cluster at `ray_address` (None: a Ray of its own); returns
    (exit code, output, JSONL rows). With a Ray of its own and the flag on, whether it ended or failed,
    nothing of the run may be left once it has exited (`assert_nothing_left`)."""
    from async_rl.demo import demo_overrides

    workdir.mkdir(parents=True, exist_ok=True)
    metrics_path = workdir / "metrics.jsonl"
    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(metrics_path), "PYTHONUNBUFFERED": "1",
           **({"RAY_ADDRESS": ray_address} if ray_address else {})}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *demo_overrides(demo_dir, extra=extra, critic=critic, agent=agent)]
    if ray_address:  # workers of a running cluster do not inherit this process's environment: verl's trainer
        # logs from its TaskRunner actor
        cmd.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={metrics_path}")
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    watch_session(proc)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        raise
    if ray_address is None and "+actor_rollout_ref.async_pipeline=True" in cmd:
        assert_nothing_left(proc, f"after the run exited ({proc.returncode}):\n{(out + err)[-2000:]}")
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
    return proc.returncode, out + err, rows


DIGESTS_SCRIPT = """
import importlib, json, os, sys
import verl
from hydra import compose, initialize_config_dir
from async_rl.build import weight_digests
from async_rl.demo import demo_overrides
from async_rl.pipeline import run_pipeline
from async_rl.run_config import read_run_config

demo_dir, out_path, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
for module in json.loads(sys.argv[4]):  # e.g. a rollout backend that registers itself on import
    importlib.import_module(module)
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                           version_base=None):
    config = compose("ppo_trainer", overrides=demo_overrides(demo_dir, extra=extra))
result = {}
history = run_pipeline(read_run_config(config), after_training=lambda built: result.update(weight_digests(built)))
with open(out_path, "w") as f:
    json.dump({"digests": result, "steps": [h for h in history if "training/global_step" in h]}, f)
"""


def run_pipeline_reading_digests(demo_dir: Path, extra: dict, workdir: Path, env=None, timeout_s: float = 900,
                                 imports: tuple = ()) -> tuple[subprocess.CompletedProcess, dict | None]:
    """The pipeline on the demo (`run_pipeline`), then `weight_digests` of every weight
    holder; returns the process and {"digests": holder -> name -> digest, "steps": the step metrics}."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl"),
           **(env or {})}
    proc = subprocess.run(digests_command(demo_dir, extra, workdir, imports),
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc, read_digests(workdir)


def digests_command(demo_dir: Path, extra: dict, workdir: Path, imports: tuple = ()) -> list[str]:
    """DIGESTS_SCRIPT's command line, its result written to `workdir`/result.json (`read_digests`)."""
    return [sys.executable, "-c", DIGESTS_SCRIPT, str(demo_dir), str(workdir / "result.json"), json.dumps(extra),
            json.dumps(list(imports))]


def start_pipeline_reading_digests(demo_dir: Path, extra: dict, workdir: Path) -> subprocess.Popen:
    """`run_pipeline_reading_digests` started in its own session, as `start_verl` starts verl's command (its
    output in metrics.jsonl.log, its Ray its own); once it has exited, `read_digests(workdir)` reads its result."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VERL_FILE_LOGGER_PATH": str(workdir / "metrics.jsonl")}
    env.pop("RAY_ADDRESS", None)
    log = open(workdir / "metrics.jsonl.log", "w")
    proc = subprocess.Popen(digests_command(demo_dir, extra, workdir), cwd=workdir, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    watch_session(proc)
    return proc


def read_digests(workdir: Path) -> dict | None:
    """What `start_pipeline_reading_digests` wrote (as `run_pipeline_reading_digests` returns it), None if nothing."""
    out = workdir / "result.json"
    return json.loads(out.read_text()) if out.exists() else None


def step_rows(rows: list[dict]) -> dict[int, dict]:
    """Training-step metrics by step (rows carrying `training/global_step`)."""
    return {r["step"]: r["data"] for r in rows if "training/global_step" in r["data"]}


def every_step_with(rows: list[dict], steps: int, keys) -> dict[int, dict]:
    """Training-step metrics by step, asserting steps 1..`steps` were all logged, each with every one of `keys`."""
    by_step = step_rows(rows)
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, metrics in by_step.items():
        missing = [key for key in keys if key not in metrics]
        assert not missing, f"step {step} lacks {missing}"
    return by_step


def val_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in rows if any(k.startswith("val-core/") for k in r["data"])}


def start_verl(demo_dir: Path, extra, workdir: Path, metrics_name: str = "metrics.jsonl", env=None,
               drop: tuple = ()) -> subprocess.Popen:
    """`python -m verl.trainer.main_ppo <demo overrides + extra, less the keys in drop>` in its own session (so
    that `kill_session` reaches every process of the run: the driver, Ray's services, every actor)."""
    from async_rl.demo import demo_overrides

    env = {**os.environ, "VERL_FILE_LOGGER_PATH": str(workdir / metrics_name), "PYTHONUNBUFFERED": "1", **(env or {})}
    overrides = [o for o in demo_overrides(demo_dir, extra=extra) if o.split("=", 1)[0] not in drop]
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides]
    log = open(workdir / f"{metrics_name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    watch_session(proc)
    return proc


def wait_until(predicate, proc, what: str, timeout_s: float = 400):
    """`predicate()`'s value once truthy (polled every 0.2 s); fails if `proc` exits first or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)


def watch_session(proc: subprocess.Popen) -> subprocess.Popen:
    """Marks `proc` (a run started in its own session) with `started_at` and `seen_pids`, every pid of its
    session seen while it runs (polled every 0.5 s from a thread), so that `assert_nothing_left` blames on
    the run only the shared-memory files its own processes made: the other lanes' runs on the machine
    make theirs too, and a SIGKILLed one leaves them."""
    import threading

    proc.started_at, proc.seen_pids = time.time(), set()

    def watch():
        while pids := session_processes(proc.pid):
            proc.seen_pids.update(pids)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name=f"watch-{proc.pid}").start()
    return proc


def assert_nothing_left(proc: subprocess.Popen, when: str, within_s: float = 15.0) -> None:
    """No process of `proc`'s session (the driver, Ray's, every actor and what they forked) is alive
    `within_s` after `proc` exited, and no weight-sync shared-memory file of its processes remains."""
    from param_update.transports.shared_memory import PREFIX, SHM_DIR

    deadline = time.monotonic() + within_s
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = subprocess.run(["ps", "-o", "pid=,ppid=,args=", "-s", str(proc.pid)], capture_output=True, text=True).stdout
    assert not session_processes(proc.pid), f"processes left {when}:\n{left}"
    started = getattr(proc, "started_at", 0.0)  # start_verl's: files of earlier runs are not this run's
    seen = getattr(proc, "seen_pids", None)  # the run's processes (watch_session): not another lane's run's
    creator = lambda f: f[len(PREFIX):].split("-")[0]  # noqa: E731 - the creator's pid follows the prefix
    files = [f for f in os.listdir(SHM_DIR) if f.startswith(PREFIX)
             and os.path.getmtime(os.path.join(SHM_DIR, f)) >= started
             and not os.path.exists(f"/proc/{creator(f)}")
             and (seen is None or (creator(f).isdigit() and int(creator(f)) in seen))]
    assert not files, f"shared-memory files left {when}: {files}"


def kill_session(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGKILL every process of `proc`'s session at once (a node lost), and wait until they are gone."""
    import signal
    import time

    for pid in session_processes(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=grace_s)
    deadline = time.monotonic() + grace_s
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not session_processes(proc.pid), "processes of the killed run survived SIGKILL"


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until `path` exists; fails if the run exits first or the time runs out."""
    import time

    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {path.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear within {timeout_s:g} s")
        time.sleep(0.1)
