"""bench/lora_sync.py runs (smallest size) and reports the adapter's bytes beside the whole model's."""

from __future__ import annotations

import json
import os

from bench_script import run_bench


def test_bench_prints_the_adapters_and_the_models_sync(tmp_path):
    out = tmp_path / "rows.json"
    proc = run_bench("lora_sync.py", ["--sizes", "2M", "--rank", "8", "--syncs", "2", "--json", out], tmp_path,
                     env={**os.environ, "RAY_ADDRESS": ""})
    assert "command: python" in proc.stdout and "lora bytes" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert row["size"] == "2M" and row["rank"] == 8
    # the whole model's float32 bytes; the adapter: r x (in + out) per adapted Linear, a fraction of them
    assert row["full_bytes"] == 4 * row["params"]
    assert 0 < row["lora_bytes"] < row["full_bytes"] / 2
    assert all(row[f"{mode}_{part}_s"] > 0 for mode in ("full", "lora") for part in ("total", "load"))
    assert all(0 <= row[f"{mode}_blocked_s"] <= row[f"{mode}_load_s"] for mode in ("full", "lora"))
