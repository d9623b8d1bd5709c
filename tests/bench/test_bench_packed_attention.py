"""bench/packed_attention.py runs (a few short samples) and writes its timings and the two variants'
agreement."""

from __future__ import annotations

import json

from bench_script import run_bench


def test_packed_attention_prints_and_writes_json(tmp_path):
    out = tmp_path / "packed.json"
    args = ["--samples", "6", "--min-len", "3", "--max-len", "9", "--repeats", "1", "--json", str(out)]
    proc = run_bench("packed_attention.py", args, tmp_path)
    assert "command: " in proc.stdout and "packed_attention.py --samples 6" in proc.stdout
    result = json.loads(out.read_text())
    assert result["samples"] == 6 and 6 * 3 <= result["packed_tokens"] <= 6 * 9
    assert result["transformers_verl_s"] > 0 and result["patched_s"] > 0
    assert result["speedup"] == result["transformers_verl_s"] / result["patched_s"]
    # the patched micro-batch computes the same log-probs as transformers' masked one
    assert result["max_abs_log_prob_difference"] < 1e-4
