"""bench/soak.py: RSS by process of a run's tree, and the growth after warm-up."""

import subprocess
import time

import psutil
import pytest

from bench import soak


def test_growth_is_measured_from_the_end_of_warm_up():
    samples = [{"step": 0, "rss_mib": {"driver": 50.0}},
               {"step": 10, "rss_mib": {"driver": 100.0, "ray::RewardStage": 200.0}},
               {"step": 20, "rss_mib": {"driver": 103.0, "ray::RewardStage": 200.0, "gone": 1.0}}]
    rows = {r["process"]: r for r in soak.growth_table(samples, warmup_steps=5)}
    assert set(rows) == {"driver", "ray::RewardStage"}  # present at both ends
    assert rows["driver"]["growth"] == pytest.approx(0.03) and rows["ray::RewardStage"]["growth"] == 0.0
    assert soak.growth_table(samples, warmup_steps=15) == []  # one sample after warm-up: nothing to compare
    assert soak.growth_table(samples, warmup_steps=5, total_steps=20) == []  # the last sample is after training


def test_the_tree_is_sampled_with_numbered_labels():
    proc = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        for _ in range(50):
            tree = soak.sample_tree(proc.pid)
            if set(tree) == {"driver", "sleep", "sleep #2"}:  # a forked child is "bash" until it execs sleep
                break
            time.sleep(0.1)
        assert set(tree) == {"driver", "sleep", "sleep #2"} and all(v > 0 for v in tree.values())
    finally:
        for child in psutil.Process(proc.pid).children():
            child.kill()
        proc.kill()
        proc.wait(5)
    assert soak.sample_tree(proc.pid) == {}  # a tree that is gone: no sample, no error


def test_a_ray_process_is_labelled_by_its_class_whatever_method_runs():
    class Titled:
        def __init__(self, title):
            self.title = title

        def cmdline(self):
            return [self.title]

    # Ray's title names the method running at the moment: the label must not change with it (a run's
    # sample mid-call labelled the stage host `ray::StageHost.call`, its next one `ray::StageHost`)
    assert {soak.process_name(Titled(t)) for t in ("ray::StageHost", "ray::StageHost.call", "ray::StageHost.add")} == {
        "ray::StageHost"}
    assert soak.process_name(Titled("ray::IDLE")) == "ray::IDLE"


def test_a_python_process_is_labelled_by_what_it_runs_past_its_options():
    class Command:
        def __init__(self, *cmd):
            self.cmd = list(cmd)

        def cmdline(self):
            return self.cmd

    cases = {("/usr/bin/python3", "-u", "-c", "print(1)"): "python -c",
             ("python", "-W", "ignore", "-m", "pytest", "-q"): "python -m pytest",
             ("python3.11", "-u", "/opt/ray/log_monitor.py", "--x"): "python log_monitor.py",
             ("/bin/bash", "-c", "true"): "bash"}
    assert [soak.process_name(Command(*cmd)) for cmd in cases] == list(cases.values())


@pytest.mark.slow
def test_a_short_soak_labels_the_stage_host(tmp_path):
    # steps 2-5 take about 2 s on a fast machine: a sample a second left fewer than the two the growth needs
    rows = soak.main(["--steps", "6", "--warmup-steps", "2", "--every-s", "0.25", "--json", str(tmp_path / "s.json")])
    names = {r["process"] for r in rows}
    assert "driver" in names and "ray::StageHost" in names, names
