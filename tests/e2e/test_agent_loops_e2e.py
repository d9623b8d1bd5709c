"""End to end: a user's own multi-turn agent loop (two_turn_loop.py, from this folder, registered
through verl's `agent_loop_config_path`) trains under the flag as under verl's own trainer, and the
demo's lookup agent trains under the flag."""

from __future__ import annotations

import os
from pathlib import Path

from helpers.lineage import dumped_step_inputs, read_jsonl
from helpers.rows import every_step_with
from helpers.runs import run_verl
from two_turn_loop import ENV_REPLY

HERE = Path(__file__).parent


def test_a_users_two_turn_loop_trains_under_the_flag_as_under_verls_trainer(demo_dir, tmp_path, ray_address,
                                                                             monkeypatch):
    """At k=1, the pipeline and verl's synchronous trainer train the same prompts, every trajectory with
    both turns and the environment's reply between them, `num_turns` 4 at every step."""
    steps = 2
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    extra = {"trainer.total_training_steps": steps, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(HERE / "two_turn_loop.yaml"),
             "actor_rollout_ref.rollout.agent.default_agent_loop": "two_turn",
             "+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH": str(HERE)}  # the Ray workers import the loop
    runs = {}
    for name, flag in (("pipeline", True), ("verl", False)):
        dumps = tmp_path / name / "dumps"
        code, out, rows = run_verl(demo_dir, {**extra, "+actor_rollout_ref.async_pipeline": flag,
                                              "+trainer.generate_ahead_steps": 1, "trainer.rollout_data_dir": str(dumps)},
                                   tmp_path / name, ray_address=ray_address)
        assert code == 0, out[-4000:]
        by_step = every_step_with(rows, steps, ["num_turns/mean", "num_turns/min"])
        assert all(m["num_turns/min"] == m["num_turns/mean"] == 4 for m in by_step.values()), by_step
        runs[name] = dumps
    pipeline = {step: read_jsonl(runs["pipeline"] / f"{step}.jsonl") for step in range(1, steps + 1)}
    assert all(ENV_REPLY in row["output"] for rows in pipeline.values() for row in rows)  # both turns, every one
    assert dumped_step_inputs(runs["pipeline"]) == dumped_step_inputs(runs["verl"])  # the same prompts, step for step


def test_the_lookup_demo_trains_under_the_flag(demo_dir, tmp_path, ray_address):
    """The demo's agent task (`overrides_agent.txt`: the lookup tool, async_rl/demo/lookup.py) runs with the
    flag: trajectories of varying turns, verl's `num_turns` metrics and the loop's `tool_call_counts` at every
    step."""
    steps = 2
    extra = {"trainer.total_training_steps": steps, "trainer.test_freq": -1, "trainer.val_before_train": False}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, ray_address=ray_address, agent=True)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, ["num_turns/min", "num_turns/max", "critic/score/mean", "tool_call_counts/max"])
    assert all(m["num_turns/min"] >= 2 for m in by_step.values()), by_step  # the prompt and an answer at least
    assert any(m["num_turns/max"] > m["num_turns/min"] for m in by_step.values()), by_step  # turns vary
    assert any(m["tool_call_counts/max"] >= 1 for m in by_step.values()), by_step
