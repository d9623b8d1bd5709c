"""The tests' leftover check (`assert_nothing_left`, tests/helpers/processes.py): a weight-sync shared-memory file
left by a process of the run fails it; one left by another run on the machine (CI runs three lanes at
once, and a SIGKILLed run leaves its files) does not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.processes import assert_nothing_left, watch_session
from param_update.transports.shared_memory import PREFIX, SHM_DIR

# a process that writes a file named as the weight sender names its regions, then dies without removing it
LEAVE_A_FILE = ("import os, sys, time\n"
                "open(os.path.join(sys.argv[1], f'{sys.argv[2]}{os.getpid()}-test{sys.argv[3]}-r0-b0-8'), 'w').close()\n"
                "time.sleep(1.5)\n")


def leave_a_file(tag: str, own_session: bool) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LEAVE_A_FILE, SHM_DIR, PREFIX, tag], start_new_session=own_session)


def ours(tag: str) -> list[str]:
    return [f for f in os.listdir(SHM_DIR) if f.startswith(PREFIX) and f"-test{tag}-" in f]


def test_only_the_runs_own_files_fail_the_check():
    tag = str(os.getpid())
    try:
        run = watch_session(leave_a_file(tag + "a", own_session=True))
        other = leave_a_file(tag + "b", own_session=True)  # another lane's run, at the same time
        assert run.wait(timeout=30) == 0 and other.wait(timeout=30) == 0
        time.sleep(1.0)  # the watcher's last look
        assert len(ours(tag + "a")) == len(ours(tag + "b")) == 1
        with pytest.raises(AssertionError, match=f"shared-memory files left.*-test{tag}a-"):
            assert_nothing_left(run, "after the fake run", within_s=1.0)
        for name in ours(tag + "a"):
            os.remove(os.path.join(SHM_DIR, name))
        assert_nothing_left(run, "after the fake run, its file removed", within_s=1.0)  # the other's is not its
    finally:
        for name in ours(tag + "a") + ours(tag + "b"):
            os.remove(os.path.join(SHM_DIR, name))
