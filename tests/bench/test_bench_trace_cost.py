"""bench/trace_cost.py: the s/step it compares and the cost it reports, and its picture of a timeline."""

import pytest

from async_rl.core.trace import write_trace
from bench import trace_cost


def rows(*step_s):
    return [{"step": 0, "data": {"val-core/x/reward/mean@1": 0.1}}] + [
        {"step": i, "data": {"timing_s/step": s}} for i, s in enumerate(step_s, 1)]


def test_the_cost_compares_steps_after_warm_up_across_interleaved_runs():
    assert trace_cost.step_seconds(rows(9.0, 1.0, 2.0), warmup=1) == [1.0, 2.0]
    runs = [{"trace": False, "step_s": [1.0, 1.0]}, {"trace": True, "step_s": [1.1, 1.0]},
            {"trace": True, "step_s": [1.0]}, {"trace": False, "step_s": [0.9, 1.1]}]
    summary = trace_cost.summarize(runs)
    assert summary["off_s_per_step"] == pytest.approx(1.0) and summary["on_s_per_step"] == pytest.approx(3.1 / 3)
    assert summary["cost"] == pytest.approx(3.1 / 3 - 1)
    assert summary["pair_costs"] == [pytest.approx(0.05), pytest.approx(0.0)]  # (off, on), then (on, off)


def test_the_picture_draws_each_stage_after_the_first_trained_step(tmp_path):
    events = {"stage generate": [("work", "process", 0.0, 1.0, {"index": 0}), ("work", "process", 1.0, 2.0, {"index": 1})],
              "stage actor_train": [("work", "process", 1.0, 1.5, {"index": 0}), ("work", "process", 2.0, 2.5, {"index": 1})]}
    write_trace(str(tmp_path / "trace.json"), [{"owner": o, "events": e, "dropped": 0} for o, e in events.items()])
    trace_cost.draw(tmp_path, str(tmp_path / "timeline.png"), seconds=2.0)
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_the_estimate_from_parts_counts_a_runs_spans_and_times_one(tmp_path):
    events = [("work", "process", float(i), i + 0.5, {"index": i}) for i in range(6)]
    write_trace(str(tmp_path / "trace.json"), [{"owner": "stage a", "events": events, "dropped": 0}])
    assert trace_cost.spans_per_step(tmp_path, steps=3) == 2.0
    assert 0.0 < trace_cost.span_cost_s(n=20_000) < 1e-3  # microseconds, not milliseconds
