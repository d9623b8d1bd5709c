"""bench/delta_sync.py runs and writes what the delta-sync issue asks for (the smallest size, one step)."""

from __future__ import annotations

import json

from bench_script import run_bench

PARTS = ("gather", "send", "recv", "register_buffer", "load")


def test_bench_compares_delta_and_full_syncs_and_checks_bits(tmp_path):
    out = tmp_path / "delta.json"
    proc = run_bench("delta_sync.py", ["--size", "2M", "--lrs", "1e-6", "--steps", "1", "--json", out], tmp_path)
    assert "command: python bench/delta_sync.py --size 2M" in proc.stdout and "bit-identical" in proc.stdout
    result = json.loads(out.read_text())
    first, second = result["rows"]
    assert (first["full_is_delta"], first["delta_is_delta"]) == (0.0, 0.0)  # nothing to diff against yet
    assert (second["full_is_delta"], second["delta_is_delta"]) == (0.0, 1.0)
    assert all(r["full_collective"] == r["delta_collective"] == 1.0 for r in result["rows"])  # the same link
    assert all(r["full_bit_identical"] and r["delta_bit_identical"] for r in result["rows"])
    summary = result["summary"]["1e-06"]
    assert summary["versions"] == 1 and summary["bit_identical"]
    assert summary["bytes_ratio"] == second["delta_bytes"] / second["full_bytes"] < 1
    assert result["link_mb_s"] > 0 and summary["crossover_mb_s"] > 0
    assert "the link between the nodes:" in proc.stdout and "where each sync's time goes" in proc.stdout
    assert result["delta_loops"].startswith("C (") and f"the delta's loops: {result['delta_loops']}" in proc.stdout
    for kind in ("full", "delta"):  # each part's median over the one steady version is that version's timer
        assert all(summary[f"{kind}_{part}_s"] == second[f"{kind}_{part}_s"] >= 0 for part in PARTS)


def test_at_the_crossover_both_syncs_take_as_long_and_a_cheaper_delta_wins_on_any_link():
    import pytest

    from bench.delta_sync import crossover_rate

    mb = 1 << 20
    here = 1000.0 * mb  # bytes/s

    def modelled(total_s: float, size_mb: float, rate: float) -> float:  # off the link here, plus the bytes at `rate`
        return total_s - size_mb * mb / here + size_mb * mb / rate

    def summary(full_total_s: float, delta_total_s: float) -> dict:  # as the bench puts it together
        return {"full_mb": 100.0, "delta_mb": 10.0, "full_off_link_s": full_total_s - 100.0 * mb / here,
                "delta_off_link_s": delta_total_s - 10.0 * mb / here}

    rate = crossover_rate(summary(0.3, 0.5))
    assert modelled(0.3, 100.0, rate) == pytest.approx(modelled(0.5, 10.0, rate))
    assert modelled(0.5, 10.0, rate / 2) < modelled(0.3, 100.0, rate / 2)  # slower link: the delta wins
    assert modelled(0.5, 10.0, rate * 2) > modelled(0.3, 100.0, rate * 2)
    assert crossover_rate(summary(0.3, 0.2)) == float("inf")
