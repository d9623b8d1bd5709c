"""pytest's hooks, options and fixtures for the suite: the fast lane (`--fast`), the demo task built once per
session, and the session's Ray clusters for the tests that can share one. What tests share besides fixtures
is in helpers/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import ray

from helpers.clusters import start_cluster

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
