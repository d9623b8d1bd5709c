"""bench/param_update.py runs and writes the rows the weight-sync issue asks for (smallest size only)."""

from __future__ import annotations

import json
import sys

from bench_script import run_bench


KEYS = {"size", "params", "pipeline_total_s", "pipeline_blocked_s", "naive_total_s", "naive_blocked_s", "raw_copy_s",
        "train_step_slowdown"}


def test_bench_prints_table_and_json(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_bench("param_update.py", ["--sizes", "2M", "--json", out], tmp_path)
    assert "command: " in proc.stdout and "blocked ratio" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert KEYS <= set(row) and row["size"] == "2M" and row["params"] > 1_000_000
    assert 0 < row["pipeline_blocked_s"] <= row["pipeline_total_s"]
    assert row["naive_blocked_s"] == row["naive_total_s"] > 0  # stop-the-world: blocked throughout
    assert row["raw_copy_s"] > 0 and row["train_step_slowdown"] > 0
    # steady state is measured after the object store has cycled; the cold first sync is reported apart
    assert 2 <= row["warmup_syncs"] <= 40
    assert row["pipeline_first_sync_s"] > 0 and row["pipeline_total_training_s"] > 0
    assert row["raw_copy_decoding_s"] > 0
    # the physical limit is the faster of torch's copy and memcpy on every core
    assert 0 < row["raw_copy_s"] <= row["raw_copy_torch_s"]
    # the put-thread counts ran in turn; the main columns are the first count's (the sender's default)
    from param_update.sender import PUT_THREADS

    assert row["put_threads"] == PUT_THREADS and set(row["by_put_threads"]) == {str(PUT_THREADS), "1"}
    assert row["by_put_threads"][str(PUT_THREADS)]["pipeline_total_s"] == row["pipeline_total_s"]
    assert all(t["pipeline_total_s"] > 0 and t["train_step_slowdown"] > 0 for t in row["by_put_threads"].values())
    assert "put threads (syncs interleaved)" in proc.stdout
    assert row["pipeline_total_idle_s"] > 0 and "no decoding" in proc.stdout
    # per link: the same-node sync through shared memory, the other-node one through the object store; the
    # wait for a running decoding step is reported apart and left out of the totals
    assert row["pipeline_step_wait_s"] >= 0 and "step wait" in proc.stdout
    links = row["links"]
    assert set(links) == {"same_node", "other_node", "other_node_collective"}
    assert "same node (shared memory)" in proc.stdout and "other node (collective, gloo)" in proc.stdout
    for link in links.values():
        assert all(isinstance(v, (int, float)) for v in link.values())
        assert link["total_s"] > 0 and link["step_wait_s"] >= 0 and link["total_with_wait_s"] >= link["total_s"]
        assert link["total_over_raw"] == link["total_s"] / row["raw_copy_s"]
        assert 0 < link["blocked_over_naive"] == link["blocked_s"] / link["naive_blocked_s"]
    receivers = {name: tuple(link[f"{n}_receivers"] for n in ("shm", "collective", "store"))
                 for name, link in links.items()}
    assert receivers == {"same_node": (1, 0, 0), "other_node": (0, 0, 1), "other_node_collective": (0, 1, 0)}
    assert links["same_node"]["total_s"] == row["pipeline_total_s"]
    # the collective against the link it uses: the bytes sent once in a gloo group to the other node
    group = links["other_node_collective"]
    assert row["raw_link_s"] > 0 and group["total_over_raw_link"] == group["total_s"] / row["raw_link_s"]
    assert group["idle_over_raw_link"] == group["total_idle_s"] / row["raw_link_s"]
    assert "the collective against the link it uses" in proc.stdout


def test_the_recorded_command_is_what_a_newcomer_types(monkeypatch, tmp_path):
    """`python bench/<script> ...` from the repository root, whatever interpreter and absolute paths ran it (one
    outside the repository as /path/to/<name>), led by GLIBC_TUNABLES when set (it changes how memcpy stores,
    bench/store_floor.py), and the commit it ran at."""
    from bench.command import ROOT, command_line, commit

    at = f"  # at commit {commit()}"
    argv = [str(ROOT / "bench" / "param_update.py"), "--sizes", "2M", "--json", str(ROOT / "bench/results/x.json"),
            f"--metrics-dir={tmp_path / 'runs'}"]
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert command_line(argv) == ("python bench/param_update.py --sizes 2M --json bench/results/x.json "
                                  "--metrics-dir=/path/to/runs" + at)
    monkeypatch.setattr(sys, "argv", ["bench/param_update.py", "--sizes", "2M"])
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.x86_non_temporal_threshold=0x100000")
    assert command_line() == ("GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x100000 "
                              "python bench/param_update.py --sizes 2M" + at)


def test_the_commit_names_head_and_changed_code(tmp_path):
    """HEAD's short hash; `+changes` once a tracked file outside bench/results differs (a results file written by
    the run does not count); `unknown` outside a checkout."""
    import subprocess

    from bench.command import commit

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout.strip()

    assert commit(tmp_path) == "unknown"
    git("init", "-q")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "r.txt").write_text("old\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "bench" / "results" / "r.txt").write_text("new\n")
    assert commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit(tmp_path) == head + "+changes"
