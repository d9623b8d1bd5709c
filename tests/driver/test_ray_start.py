"""The run's own Ray start (`async_rl.pipeline.init_ray`): when Ray's node does not register in time (Ray's
30 s, which a loaded machine exceeds), the processes the failed start left are killed and Ray is started
again; any other error is raised at once. `ray.init` is a stand-in here that starts a real child process,
as Ray's failed start leaves its GCS and raylet."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

import async_rl.pipeline as pipeline_module
from async_rl.pipeline import RAY_START_ATTEMPTS, init_ray

RAY_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                        "failed to startup or the GCS has become overloaded.")


class FakeRayInit:
    """Each call starts a child process (what a Ray start leaves running) and raises the next of `errors`
    (None: the start succeeds)."""

    def __init__(self, errors):
        self.errors, self.calls, self.children = list(errors), [], []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        self.children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        error = self.errors.pop(0)
        if error is not None:
            raise error


@pytest.fixture
def fake_ray(monkeypatch):
    """Installs a FakeRayInit with the given errors; its children are killed at the test's end."""
    installed = []

    def install(errors):
        installed.append(FakeRayInit(errors))
        monkeypatch.setattr(pipeline_module.ray, "init", installed[-1])
        monkeypatch.setattr(pipeline_module.ray, "shutdown", lambda: None)
        return installed[-1]

    yield install
    for child in (child for fake in installed for child in fake.children):
        child.kill()
        child.wait(timeout=10)


def test_a_start_that_timed_out_is_tried_again_after_killing_what_it_left(fake_ray, capsys):
    fake = fake_ray([RAY_TIMEOUT, None])
    init_ray({"num_cpus": 2})
    assert fake.calls == [{"num_cpus": 2}] * 2
    first, second = fake.children
    assert not psutil.pid_exists(first.pid)  # killed (and reaped) before the second start
    assert second.poll() is None  # the start that succeeded keeps its processes
    assert "Ray's node did not start in time" in capsys.readouterr().out


def test_the_attempts_are_bounded_and_the_last_error_is_raised(fake_ray):
    fake = fake_ray([RAY_TIMEOUT] * RAY_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray({})
    assert len(fake.calls) == RAY_START_ATTEMPTS


def test_another_error_is_raised_at_once(fake_ray):
    fake = fake_ray([ValueError("bad address"), None])
    with pytest.raises(ValueError, match="bad address"):
        init_ray({})
    assert len(fake.calls) == 1
