"""On-policy distillation end to end (`distillation.enabled=True`): under the flag, a teacher on the CPU backend
scores every training trajectory through verl's agent loop, and the train ranks add verl's distillation loss
to the policy loss; verl's own trainer, flag off, runs the same teacher on the CPU backend. The teacher is the
student's own starting model, so on-policy (k = 1) the first step's student and teacher distributions are the
same, token for token, and its loss is zero; a teacher score shifted by one token, or on the wrong rows, would
not be."""

from __future__ import annotations

import pytest

from helpers.rows import every_step_with
from helpers.runs import run_verl

STEPS = 3
DISTILLATION_METRICS = ("actor/distillation/loss", "actor/distillation/abs_loss", "actor/distillation/loss_max")


def distillation_keys(demo_dir) -> dict:
    return {"distillation.enabled": True, "distillation.nnodes": 1, "distillation.n_gpus_per_node": 1,
            "distillation.teacher_models.teacher_model.model_path": str(demo_dir / "model"),
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size": 1,
            "distillation.distillation_loss.loss_mode": "k3", "distillation.distillation_loss.use_policy_gradient": False,
            "trainer.total_training_steps": STEPS, "trainer.test_freq": STEPS, "+trainer.generate_ahead_steps": 1}


@pytest.mark.slow
@pytest.mark.parametrize("flag", [True, False], ids=["pipeline", "verls_trainer"])
def test_the_teacher_scores_every_trajectory_and_the_loss_starts_at_zero(demo_dir, tmp_path, ray_address, flag):
    keys = distillation_keys(demo_dir)
    if not flag:
        keys = {**keys, "+actor_rollout_ref.async_pipeline": False}
        del keys["+trainer.generate_ahead_steps"]  # verl's trainer is on-policy
    code, out, rows = run_verl(demo_dir, keys, tmp_path, ray_address=ray_address)
    assert code == 0, out[-3000:]
    assert ("async-rl" in out) == flag  # the pipeline ran, or verl's trainer
    by_step = every_step_with(rows, STEPS, DISTILLATION_METRICS + ("actor/pg_loss", "critic/score/mean"))
    first = by_step[1]
    assert abs(first["actor/distillation/loss"]) < 1e-5 and first["actor/distillation/loss_max"] < 1e-4, first
    # the student has moved away from its starting weights: the teacher's scores now differ from its own
    assert by_step[STEPS]["actor/distillation/abs_loss"] > 1e3 * max(first["actor/distillation/abs_loss"], 1e-12)
