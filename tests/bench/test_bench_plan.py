"""bench/plan_sim.py runs (a few cluster sizes) and writes its table, JSON and plot."""

from __future__ import annotations

import json

from bench_script import run_bench


def test_plan_sim_prints_and_writes_table_json_and_png(tmp_path):
    out = tmp_path / "results" / "sim"
    proc = run_bench("plan_sim.py", ["--gpus", "8,16,64", "--out", out], tmp_path, timeout_s=300)
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["gpus", "async_s", "sync_s", "speedup", "bubble", "devices", "override"]
    table = [line.split() for line in lines[1:4]]
    assert [int(row[0]) for row in table] == [8, 16, 64]
    for row in table:
        async_s, sync_s, speedup = float(row[1]), float(row[2]), float(row[3].rstrip("x"))
        assert async_s > 0 and sync_s > 0 and abs(speedup - sync_s / async_s) < 0.01
        assert row[-1].startswith("+trainer.use_nodes_ratios=[")
    assert "command: " in proc.stdout and "plan_sim.py --gpus 8,16,64" in proc.stdout
    text = (tmp_path / "results" / "sim.txt").read_text()
    assert text.splitlines()[:4] == lines[:4]
    result = json.loads((tmp_path / "results" / "sim.json").read_text())
    assert [r["gpus"] for r in result["rows"]] == [8, 16, 64] and result["workload"]["tail_s"] > 0
    assert all(r["async_step_s"] > 0 and r["sync_step_s"] > 0 and 0 <= r["bubble"] < 1 for r in result["rows"])
    png = (tmp_path / "results" / "sim.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000
