"""On-policy distillation end to end (`distillation.enabled=True`): under the flag, a teacher on the CPU backend
scores every training trajectory through verl's agent loop, and the train ranks add verl's distillation loss
to the policy loss. The teacher is the student's own starting model, so on-policy (k = 1) the first step's
student and teacher distributions are the same, token for token, and its loss is zero; a teacher score shifted
by one token, or on the wrong rows, would not be. The run routes the rollout's and the teacher's requests
through a user's load balancer (`router_config_path`, tests/rollout/recording_router.py), which records each
request it routes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from async_rl.demo.task import GROUP_SIZE, TRAIN_BATCH_SIZE
from helpers.rows import every_step_with
from helpers.runs import run_verl

ROUTER_DIR = Path(__file__).resolve().parents[1] / "rollout"  # `recording_router`, for the processes that build routers

STEPS = 3
DISTILLATION_METRICS = ("actor/distillation/loss", "actor/distillation/abs_loss", "actor/distillation/loss_max")


def distillation_keys(demo_dir) -> dict:
    return {"distillation.enabled": True, "distillation.nnodes": 1, "distillation.n_gpus_per_node": 1,
            "distillation.teacher_models.teacher_model.model_path": str(demo_dir / "model"),
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size": 1,
            "distillation.distillation_loss.loss_mode": "k3", "distillation.distillation_loss.use_policy_gradient": False,
            "trainer.total_training_steps": STEPS, "trainer.test_freq": STEPS, "+trainer.generate_ahead_steps": 1}


@pytest.mark.slow
def test_the_teacher_scores_every_trajectory_and_the_loss_starts_at_zero(demo_dir, tmp_path, ray_address, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ":".join(filter(None, [str(ROUTER_DIR), os.environ.get("PYTHONPATH")])))
    records = {role: tmp_path / f"{role}_routed.jsonl" for role in ("rollout", "teacher")}
    for role, record in records.items():
        (tmp_path / f"{role}_router.yaml").write_text(f"router_class: recording_router.RecordingRouter\n"
                                                      f"record: {record}\n")
    keys = {**distillation_keys(demo_dir), "+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH": str(ROUTER_DIR),
            "actor_rollout_ref.rollout.router_config_path": str(tmp_path / "rollout_router.yaml"),
            "+distillation.teacher_models.teacher_model.inference.router_config_path":
                str(tmp_path / "teacher_router.yaml")}
    code, out, rows = run_verl(demo_dir, keys, tmp_path, ray_address=ray_address)
    assert code == 0, out[-3000:]
    assert "async-rl" in out  # the pipeline ran
    by_step = every_step_with(rows, STEPS, DISTILLATION_METRICS + ("actor/pg_loss", "critic/score/mean"))
    first = by_step[1]
    assert abs(first["actor/distillation/loss"]) < 1e-5 and first["actor/distillation/loss_max"] < 1e-4, first
    # the student has moved away from its starting weights: the teacher's scores now differ from its own
    assert by_step[STEPS]["actor/distillation/abs_loss"] > 1e3 * max(first["actor/distillation/abs_loss"], 1e-12)
    # each router routed every training trajectory's requests (validation's too, for the rollout's) and heard
    # them end (a release is sent without waiting: the run's last ones may not reach the router before its end)
    trajectories = STEPS * TRAIN_BATCH_SIZE * GROUP_SIZE
    for role, record in records.items():
        lines = [json.loads(line) for line in record.read_text().splitlines()]
        acquired = {line["request"] for line in lines if "server" in line}
        released = [line["request"] for line in lines if "released" in line]
        assert len(acquired) >= trajectories and len(released) >= trajectories, (role, len(acquired), len(released))
        assert set(released) <= acquired and all(line["prompt_tokens"] > 0 for line in lines if "server" in line)
