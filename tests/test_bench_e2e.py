"""bench/e2e.py's summary: the numbers the side-by-side table reports, from metric rows."""

import pytest
from conftest import load_bench

e2e = load_bench("e2e")


def rows_for(step_s, val_key, vals, **busy):
    """Metric rows as verl's file logger writes them: one per step, validation on some steps."""
    rows = [{"step": 0, "data": {val_key: vals[0]}}]
    for step in range(1, 5):
        data = {"timing_s/step": step_s, "response_length/mean": 10.0, "response_length/max": 20.0, **busy}
        if step in vals:
            data[val_key] = vals[step]
        rows.append({"step": step, "data": data})
    return rows


def test_pipeline_summary_bubble_and_chain():
    busy = {"async/actor_train/busy_ratio": 0.5, "async/logp/busy_ratio": 0.4, "async/generate/busy_ratio": 0.2}
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 2: 0.3, 4: 0.5}, **busy)
    row, curve = e2e.summarize("async-pipeline k=2", 2, rows, samples_per_step=8, target=0.4)
    assert row["wall_s_per_sample"] == pytest.approx(8.0 / 32)  # 4 steps x 2 s over 4 x 8 samples
    assert curve == [(0, 0.0), (4.0, 0.3), (8.0, 0.5)]
    assert row["time_to_target_s"] == 8.0 and row["final_val_reward"] == 0.5
    assert row["busiest_stage"] == "actor_train" and row["bubble_ratio"] == pytest.approx(2.0)
    assert row["train_chain_busy"] == pytest.approx(0.9)


def test_verl_summary_reads_val_aux_and_step_parts():
    parts = {"timing_s/gen": 1.5, "timing_s/update_actor": 0.3}
    rows = rows_for(2.0, e2e.VAL_KEYS[1], {0: 0.0, 4: 0.2}, **parts)
    row, _ = e2e.summarize("verl-sync", None, rows, samples_per_step=8, target=0.4)
    assert row["final_val_reward"] == 0.2 and row["time_to_target_s"] is None
    assert row["busiest_stage"] == "gen" and row["bubble_ratio"] == pytest.approx(2.0 / 1.5)
    assert row["train_chain_busy"] is None


def summarized(k, **busy):
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.5}, **{f"async/{s}/busy_ratio": b for s, b in busy.items()})
    return e2e.summarize(f"async-pipeline k={k}", k, rows, samples_per_step=8, target=0.4)[0]


def test_bottleneck_names_the_cause_only_above_the_goal():
    assert e2e.bottleneck(summarized(2, actor_train=0.95, generate=0.5)) is None  # bubble 1.05
    chain = e2e.bottleneck(summarized(2, actor_train=0.6, logp=0.35, generate=0.2))
    assert "actor_train and logp take turns" in chain and "proximal_logp_workers=train" in chain
    assert "synchronous" in e2e.bottleneck(summarized(1, actor_train=0.6, generate=0.35))
    waits = e2e.bottleneck(summarized(2, actor_train=0.7, generate=0.6, reward=0.1))
    assert waits.startswith("bottleneck: actor_train (busy 0.70)") and "generate 0.60" in waits


def test_ppo_summaries_count_the_critics_parts_and_stages():
    verl_parts = {"timing_s/gen": 0.5, "timing_s/values": 0.2, "timing_s/update_critic": 0.9, "timing_s/update_actor": 0.3}
    row, _ = e2e.summarize("verl-sync PPO", None, rows_for(2.0, e2e.VAL_KEYS[1], {0: 0.0}, **verl_parts), 8, 0.4)
    assert row["busiest_stage"] == "update_critic" and row["busy_ratio"]["values"] == pytest.approx(0.1)
    pipeline = summarized(2, actor_train=0.5, critic_train=0.8, values=0.3)
    assert pipeline["busiest_stage"] == "critic_train" and pipeline["bubble_ratio"] == pytest.approx(1 / 0.8)
