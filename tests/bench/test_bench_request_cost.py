"""bench/request_cost.py runs (16 requests, one round) and splits each receiver's CPU into its forwards and the rest."""

from __future__ import annotations

import json
import os

from bench_script import run_bench


def test_bench_splits_the_servers_cpu_and_measures_rays_call_alone(tmp_path):
    out = tmp_path / "cost.json"
    proc = run_bench("request_cost.py", ["--requests", "16", "--gap-ms", "10", "--rounds", "1", "--window-ms", "300",
                                         "--json", out],
                     tmp_path, env={**os.environ, "RAY_ADDRESS": ""})
    assert "command: python" in proc.stdout and "Ray's call alone" in proc.stdout
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {f"{name} | {sent}" for name in ("server, window 300 ms", "server, window 0",
                                                          "empty Ray actor") for sent in ("burst", "paced")}
    for case in cases.values():
        assert 0 <= case["forwards_ms"] < case["cpu_ms"]  # the forwards' threads are part of the process
    for sent in ("burst", "paced"):
        assert cases[f"empty Ray actor | {sent}"]["forwards"] == 0 == cases[f"empty Ray actor | {sent}"]["tokens"]
        for name in ("server, window 300 ms", "server, window 0"):  # every request generated its tokens
            assert cases[f"{name} | {sent}"]["forwards"] >= 1 and 1 <= cases[f"{name} | {sent}"]["tokens"] <= 4
    # without a window, requests 10 ms apart are prefilled one by one: many more forwards than sent at once;
    # all 16 fall inside one 300 ms window, prefilled together
    paced, burst = cases["server, window 0 | paced"]["forwards"], cases["server, window 0 | burst"]["forwards"]
    assert paced > 1.5 * burst
    assert paced > 1.5 * cases["server, window 300 ms | paced"]["forwards"]
