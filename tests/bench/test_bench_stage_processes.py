"""bench/stage_processes.py: its summary of the runs (the runs themselves are the bench's)."""

from __future__ import annotations

import pytest

from bench import stage_processes


def test_the_summary_takes_medians_after_warm_up_and_the_ratios_per_stage_to_per_node():
    runs = {"per_node": [{"wall_s": 100.0, "step_s": [9.0, 1.0, 2.0, 3.0]}],
            "per_stage": [{"wall_s": 130.0, "step_s": [9.0, 2.0, 2.0, 2.0]},
                          {"wall_s": 150.0, "step_s": [9.0, 4.0]}]}
    result = stage_processes.summarize(runs, warmup_steps=1)
    assert result["modes"] == {"per_node": {"wall_s": 100.0, "step_s": 2.0}, "per_stage": {"wall_s": 140.0, "step_s": 2.0}}
    assert result["wall_ratio"] == pytest.approx(1.4) and result["step_ratio"] == 1.0
