"""bench/packed_attention.py runs (a few short samples) and writes its timings and the two variants'
agreement; the patched variant attends per sample, the other over the whole packed sequence."""

from __future__ import annotations

import json
import time

from bench_script import run_bench


def test_packed_attention_prints_and_writes_json(tmp_path):
    out = tmp_path / "packed.json"
    args = ["--samples", "6", "--min-len", "3", "--max-len", "9", "--repeats", "1", "--json", str(out)]
    start = time.monotonic()
    proc = run_bench("packed_attention.py", args, tmp_path)
    wall = time.monotonic() - start
    assert "command: " in proc.stdout and "packed_attention.py --samples 6" in proc.stdout
    result = json.loads(out.read_text())
    tokens = result["packed_tokens"]
    assert result["samples"] == 6 and 6 * 3 <= tokens <= 6 * 9
    # what each timing timed: transformers' sdpa over the whole packed sequence (one row of every token,
    # under the S x S mask), the patched one over the 6 samples padded to the longest (3 to 9 tokens);
    # the same number of attention calls (one per layer) in both
    base, patched = result["sdpa_query_shapes"]["transformers + verl"], result["sdpa_query_shapes"]["patched"]
    assert base and len(base) == len(patched)
    assert all(shape[0] == 1 and shape[2] == tokens for shape in base), base
    assert all(shape[0] == 6 and 3 <= shape[2] <= 9 and shape[2] < tokens for shape in patched), patched
    assert "patched: %d attention calls over queries of shape" % len(patched) in proc.stdout
    # one timed round each (--repeats 1): both fit in the process's life, as this test clocks it
    assert 0 < result["transformers_verl_s"] and 0 < result["patched_s"]
    assert result["transformers_verl_s"] + result["patched_s"] < wall
    # the patched micro-batch computes the same log-probs as transformers' masked one
    assert result["max_abs_log_prob_difference"] < 1e-4
