"""A run's processes: waiting on what it writes, watching its session, killing it, and checking that
nothing of it is left once it has exited."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from async_rl.stop_signals import session_processes


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
