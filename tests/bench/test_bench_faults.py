"""bench/faults.py: the accounting behind its table (the runs themselves are the bench's)."""

from __future__ import annotations

from collections import Counter

import pytest

from bench import faults


def row(**kw):
    base = {"fault": "rollout_server_sigkill", "inject_step": 4, "outcome": "completed", "detect_s": 1.5,
            "recover_s": 3.0, "steps_redone": 0, "steps_missing": 0, "samples_lost": 0, "samples_twice": 0,
            "final_val": 0.4}
    return {**base, **kw}


def test_lineage_counts_samples_lost_and_trained_twice_per_step():
    expected = {1: Counter({"a": 2, "b": 2}), 2: Counter({"c": 4})}
    assert faults.compare_lineage(expected, {1: Counter({"a": 2, "b": 2}), 2: Counter({"c": 4})}) == (0, 0)
    # step 1 lost a "b", step 2 trained one "c" twice, and a step 3 nobody asked for
    dumped = {1: Counter({"a": 2, "b": 1}), 2: Counter({"c": 5}), 3: Counter({"d": 1})}
    assert faults.compare_lineage(expected, dumped) == (1, 2)
    assert faults.compare_lineage(expected, {}) == (8, 0)


@pytest.mark.parametrize("change,ok", [
    ({}, True),
    ({"detect_s": 31.0}, False),  # detected past the 30 s goal
    ({"detect_s": None}, False),  # never named
    ({"samples_lost": 1}, False),
    ({"samples_twice": 2}, False),
    ({"steps_missing": 1}, False),
    ({"outcome": "hung (killed after 900 s)"}, False),
    ({"steps_redone": 2}, True),  # a restart from a checkpoint redoes steps; the lineage is what counts
])
def test_verdict_applies_the_issue_goal(change, ok):
    assert (faults.verdict(row(**change)) == "ok") is ok


@pytest.mark.parametrize("fault", faults.STOPS)
@pytest.mark.parametrize("change,ok", [
    ({"stop_s": 6.0, "procs_left": 0}, True),
    ({"stop_s": 26.0, "procs_left": 0}, False),  # past trainer.stop_deadline_s: Slurm's SIGKILL would come first
    ({"stop_s": 6.0, "procs_left": 3}, False),  # processes of the run outlived it
    ({"stop_s": None, "procs_left": None}, False),  # never stopped
])
def test_a_stop_signal_must_end_the_run_within_the_deadline_leaving_nothing(fault, change, ok):
    assert (faults.verdict(row(fault=fault, **change)) == "ok") is ok


def test_table_compares_with_the_unfaulted_run():
    table = faults.format_table([row(fault="none", inject_step=None, detect_s=None, recover_s=None, final_val=0.5),
                                 row(final_val=0.45)])
    lines = table.splitlines()
    assert lines[2].split()[0] == "none" and lines[2].endswith("ok")
    assert "-0.05" in lines[3] and lines[3].endswith("ok")
