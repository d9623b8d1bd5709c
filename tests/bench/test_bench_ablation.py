"""bench/ablation.py's summary over seeds and the eta comparison it prints."""

import pytest

from bench import ablation


def run(eta, decoupled, reward, wall_s, seed):
    return {"eta": eta, "decoupled": decoupled, "final_val_reward": reward, "wall_s": wall_s, "seed": seed}


def test_summary_groups_by_configuration_over_seeds():
    rows = [
        run(0, True, 1.0, 300.0, 0), run(0, False, 0.5, 250.0, 0), run(4, True, 0.9, 240.0, 0),
        run(0, True, 0.8, 320.0, 1), run(0, False, 0.7, 270.0, 1), run(4, True, 1.0, 260.0, 1),
    ]
    summary = ablation.summarize(rows)
    assert [(g["eta"], g["decoupled"], g["runs"]) for g in summary] == [(0, True, 2), (0, False, 2), (4, True, 2)]
    base, naive, eta4 = summary
    assert base["mean_reward"] == pytest.approx(0.9) and base["worst_reward"] == 0.8
    assert base["mean_wall_s"] == pytest.approx(310.0)
    assert naive["mean_reward"] == pytest.approx(0.6) and naive["worst_reward"] == 0.5
    assert eta4["mean_reward"] == pytest.approx(0.95) and eta4["worst_reward"] == 0.9


def test_comparison_is_decoupled_against_decoupled_eta0():
    summary = ablation.summarize([
        run(0, True, 0.9, 300.0, 0), run(0, False, 1.0, 100.0, 0),
        run(2, False, 0.1, 50.0, 0), run(4, True, 0.8, 240.0, 0),
    ])
    lines = ablation.comparisons(summary)
    assert len(lines) == 1  # naive runs are not compared, eta 0 is the base
    assert lines[0].startswith("decoupled eta=4 vs eta=0: mean reward -0.100 (worst seed -0.100), wall time x0.80")


def test_no_comparison_without_a_decoupled_base():
    assert ablation.comparisons(ablation.summarize([run(4, True, 0.8, 240.0, 0)])) == []
