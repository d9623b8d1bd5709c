"""A scheduler's stop, the parts that need no run: processes started under `sigterm_blocked` keep
running through SIGTERM, the driver's stop request has a deadline and a second signal stops at
once, and a DataLoader worker dies with the process that iterates it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
import threading
import time

import psutil
import pytest

from async_rl.stop_signals import StopRequest, sigterm_blocked


def sigterm_blocked_in(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_started_under_sigterm_blocked_outlives_sigterm_and_the_callers_mask_is_restored():
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with sigterm_blocked():
        shielded = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
        time.sleep(0.5)  # both interpreters started
        assert sigterm_blocked_in(shielded.pid) and not sigterm_blocked_in(plain.pid)
        shielded.send_signal(signal.SIGTERM)
        plain.send_signal(signal.SIGTERM)
        assert plain.wait(timeout=10) == -signal.SIGTERM
        time.sleep(0.5)
        assert shielded.poll() is None  # the signal waits, blocked, while it runs
    finally:
        for proc in (shielded, plain):
            proc.kill()
            proc.wait(timeout=10)


def test_the_first_signal_starts_the_deadline_and_a_second_stops_at_once():
    fired = []
    done = threading.Event()
    request = StopRequest(deadline_s=0.3, on_deadline=lambda signum: (fired.append(signum), done.set()))
    assert not request.requested and request.seconds_left() == 0.3
    request.handle(signal.SIGTERM, None)
    assert request.requested and request.signum == signal.SIGTERM
    assert 0 < request.seconds_left() <= 0.3
    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        request.handle(signal.SIGINT, None)
    assert done.wait(5) and fired == [signal.SIGTERM]


def test_a_stop_that_ended_in_time_cancels_its_deadline():
    fired = []
    request = StopRequest(deadline_s=0.2, on_deadline=fired.append)
    request.handle(signal.SIGINT, None)
    request.cancel()
    time.sleep(0.5)
    assert fired == []


DATALOADER_SCRIPT = textwrap.dedent("""
    import functools, os, sys, time
    import torch
    from torch.utils.data import DataLoader
    from async_rl.core.prompts import die_with_parent
    class Rows(torch.utils.data.Dataset):  # rows pickled through the workers' result pipe, as verl's are
        def __len__(self):
            return 10_000
        def __getitem__(self, i):
            return {"raw_prompt": "x" * 1_000_000}
    loader = DataLoader(Rows(), batch_size=1, num_workers=2, prefetch_factor=8,
                        worker_init_fn=functools.partial(die_with_parent, parent=os.getpid()))
    batches = iter(loader)
    next(batches)
    print(" ".join(str(w.pid) for w in batches._workers), flush=True)
    time.sleep(120)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_dataloader_workers_die_with_a_killed_parent():
    parent = subprocess.Popen([sys.executable, "-c", DATALOADER_SCRIPT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
    assert len(workers) == 2 and all(w.is_running() for w in workers)
    parent.kill()  # as ray.kill of the dataloader stage, or a crash: no chance to stop its workers
    parent.wait(timeout=10)
    _gone, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive, f"orphaned DataLoader workers: {[w.pid for w in alive]}"


def test_the_training_dataloader_has_its_workers_die_with_the_stage(demo_dir):
    from transformers import AutoTokenizer

    from async_rl.core.prompts import die_with_parent, load_prompt_dataset, make_train_dataloader
    from async_rl.demo import demo_overrides
    from helpers.lineage import compose_ppo

    config = compose_ppo(demo_overrides(demo_dir))
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    dataset = load_prompt_dataset(config.data.train_files, config.data, tokenizer, is_train=True)
    init = make_train_dataloader(config.data, dataset).worker_init_fn
    assert init.func is die_with_parent and init.keywords == {"parent": os.getpid()}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_shield_runs_a_command_that_outlives_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "async_rl.sigterm_shield", "sleep", "60"],
                            cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).name() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.05)  # exec'd: the same pid is now `sleep`
        assert sigterm_blocked_in(proc.pid)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=10)
    no_command = subprocess.run([sys.executable, "-m", "async_rl.sigterm_shield"], cwd=Path(__file__).parents[2],
                                capture_output=True, text=True)
    assert no_command.returncode == 2 and "sigterm_shield CMD" in no_command.stderr
