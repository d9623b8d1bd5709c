"""verl's own `tool_agent` loop with its hermes tool parser and a verl function tool, under the flag on
the CPU backend: the model (taught to call, tests/e2e/tool_task.py) writes a tool call, verl's parser
reads it, the tool answers, the model answers again; the trajectories are trained and the reward needs
the reply. (That tool tokens get no gradient: tests/core/test_decoupled_ppo.py, tests/rollout/test_agent_loops.py.)"""

from __future__ import annotations

import json

import pytest

import tool_task
from helpers.rows import every_step_with
from helpers.runs import run_verl


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    built = tool_task.build(tmp_path_factory.mktemp("tool_task"))
    assert built["p_taught"] > 0.95, built  # the model learnt to call: at 0.95 the bar below fails 2e-5 of runs
    return built["root"]


def test_verls_tool_agent_calls_the_tool_under_the_flag(demo_dir, task, tmp_path, ray_address):
    dump = tmp_path / "dump"
    extra = {**tool_task.overrides(task), "trainer.total_training_steps": 2,
             "trainer.test_freq": 2, "trainer.val_before_train": False, "trainer.rollout_data_dir": str(dump)}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    steps = every_step_with(rows, 2, ["num_turns/mean", "agent_loop/tool_calls/mean", "response_length/mean"])
    dumped = [json.loads(line) for path in sorted(dump.glob("*.jsonl")) for line in path.read_text().splitlines()]
    assert len(dumped) == 2 * 4 * 4
    called = [row for row in dumped if row["output"].startswith(tool_task.CALL_TEXT + "<tool_response>42</tool_response>=")]
    assert len(called) >= len(dumped) * 3 // 4, [row["output"] for row in dumped]  # sampled at temperature 1
    # the task's reward: the answer right after the tool's reply (a sampled tail can end in "=42" elsewhere)
    assert all(row["score"] == float(row["output"].endswith(f"</tool_response>={tool_task.VALUE}")) for row in dumped)
    assert sum(row["score"] for row in dumped) >= len(called) // 2  # the model answers what the tool said
    for metrics in steps.values():
        assert metrics["num_turns/max"] == 4  # user, the call, the tool's reply, the answer
        assert metrics["agent_loop/tool_calls/mean"] > 0  # seconds in the tool, verl's AgentLoopMetrics
