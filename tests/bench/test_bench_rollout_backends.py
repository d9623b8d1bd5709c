"""bench/rollout_backends.py runs both backends on the demo model and writes its table (vllm venv): each
generates every requested token and its timed loads put the new weights in place."""

from __future__ import annotations

import json
import time

import pytest

from bench_script import run_bench


@pytest.mark.vllm
def test_rollout_backends_bench_prints_and_writes_json(tmp_path):
    out = tmp_path / "backends.json"
    args = ["--prompts", "4", "--samples", "2", "--max-tokens", "3", "--repeats", "1", "--json", str(out)]
    start = time.monotonic()
    proc = run_bench("rollout_backends.py", args, tmp_path)
    wall = time.monotonic() - start
    assert "command: " in proc.stdout and "vllm/cpu:" in proc.stdout
    result = json.loads(out.read_text())
    assert result["requests"] == 8 and len(result["rows"]) == 1
    row = result["rows"][0]
    for backend in ("cpu", "vllm"):
        assert row[backend]["tokens"] == 8 * 3  # EOS ignored: every response is max-tokens long
        # the timed loads loaded the new weights (the model's own differ from them by ~1e-3 noise)
        assert row[backend]["loaded_max_abs_difference"] < 1e-6, row[backend]
        # one timed round each (--repeats 1): generation and load fit in the process's life, as this test clocks it
        assert 0 < row[backend]["gen_s"] and 0 < row[backend]["load_s"]
        assert row[backend]["gen_s"] + row[backend]["load_s"] < wall
