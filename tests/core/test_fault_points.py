"""The fault points tests and benches use (async_rl/core/fault_points.py): a delay asked for one part."""

from async_rl.core.fault_points import DELAY_ENV, delay_for


def test_a_delay_applies_to_the_named_point_and_index_only(monkeypatch):
    assert delay_for("rollout_replica", 1) == 0.0
    monkeypatch.setenv(DELAY_ENV, "rollout_replica@1=0.25, other@0=3")
    assert delay_for("rollout_replica", 1) == 0.25 and delay_for("other", 0) == 3.0
    assert delay_for("rollout_replica", 0) == 0.0 and delay_for("rollout_replica", 10) == 0.0
