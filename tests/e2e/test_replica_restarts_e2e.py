"""A rollout replica lost mid-run, through verl's command line with the flag: the demo on two CPU
rollout replicas, one server SIGKILLed and later the other SIGSTOPped (a hang). Each is restarted
with the newest weights, the requests it held are resubmitted, and the run ends with every step
trained once on the prompts an unfaulted run trains (verl's rollout dumps against verl's
dataloader), staleness within the bound."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from bench import faults
from helpers.lineage import dumped_step_inputs, expected_step_inputs, read_jsonl
from helpers.processes import assert_nothing_left, wait_until
from helpers.rows import step_rows
from helpers.runs import start_verl

STEPS = 60  # long enough after the hang's detection (30 s) for its restart (~7 s) before the end: at ~0.35 s
# a step, 30 steps once ended first
K = 2
REQUEST_TIMEOUT_S = 30


def rollout_servers(proc) -> list:
    """The run's CPU rollout server processes, oldest first."""
    return faults.titled_processes(proc.pid, "ray::CPURolloutServer")


def logged_steps(path) -> dict[int, dict]:
    return step_rows(read_jsonl(path))


@pytest.mark.slow
def test_lost_and_hung_rollout_servers_are_restarted_and_nothing_is_lost(demo_dir, tmp_path):
    dumps = tmp_path / "dumps"
    extra = {"trainer.total_training_steps": STEPS, "trainer.test_freq": 5, "trainer.rollout_data_dir": str(dumps),
             "+trainer.generate_ahead_steps": K,
             "trainer.n_gpus_per_node": 4, "+trainer.use_nodes_ratios": [0.25, 0.25, 0.25, 0.5],  # 2 replicas
             "+actor_rollout_ref.rollout.request_timeout_s": REQUEST_TIMEOUT_S}
    metrics, log_path = tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.log"
    proc = start_verl(demo_dir, extra, tmp_path)
    try:
        wait_until(lambda: len(logged_steps(metrics)) >= 2, proc, "step 2")
        servers = rollout_servers(proc)
        assert len(servers) == 2, [s.cmdline() for s in servers]
        originals = {s.pid for s in servers}
        servers[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: "back (restart 1)" in log_path.read_text(), proc, "the restart after the SIGKILL")
        restart_s = time.monotonic() - killed_at
        assert len({s.pid for s in rollout_servers(proc)} - originals) == 1  # a new process serves replica
        hung_at_step = max(logged_steps(metrics))
        os.kill(servers[1].pid, signal.SIGSTOP)  # the surviving original hangs
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = log_path.read_text()
    assert proc.returncode == 0, log[-4000:]
    assert_nothing_left(proc, "after the run's end (two servers killed and restarted)")
    by_step = logged_steps(metrics)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    assert all(m["async/staleness/max"] <= K - 1 for m in by_step.values())
    assert by_step[STEPS]["async/faults/replica_restarts"] == 2.0
    assert by_step[1]["async/faults/replica_restarts"] == 0.0
    # resubmissions: none before the first loss, counted cumulatively, and at least one for each loss a
    # request saw first (its own resubmission; the weight sync names what it was doing: "... during load",
    # "no answer to load of version ...")
    resubmitted = [by_step[s]["async/faults/requests_resubmitted"] for s in sorted(by_step)]
    assert resubmitted[0] == 0.0 and resubmitted == sorted(resubmitted), resubmitted
    causes = re.findall(r"rollout replica \d lost \((.*)\): restart", log)
    assert len(causes) == 2, causes
    seen_by_requests = [c for c in causes if " during " not in c and " of version " not in c]
    assert resubmitted[-1] >= len(seen_by_requests), (causes, resubmitted[-1])
    assert "lost (ActorDiedError" in log
    assert "lost (no answer to" in log and "within 30 s" in log  # a request or the weight sync, whichever first
    # every step trained the prompts an unfaulted run trains at that step, each sample once
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, STEPS)
    assert log.count("back (restart 1)") == 2
    assert hung_at_step < STEPS
    print(f"replica back {restart_s:.1f} s after the SIGKILL; SIGSTOP after step {hung_at_step}")
