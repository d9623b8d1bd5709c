"""`+algorithm.proximal_logp_method=update_forward` on verl's real FSDP2 engine worker: the update's own forward
as pi_prox gives the loss and gradient a recomputed pi_prox gives (verl's forward pass, then verl's importance
weights), for one batch whose behaviour policy is far enough from pi_prox that the cap drops tokens."""

from __future__ import annotations

import pytest

from helpers.engine_workers import run_on_workers

SCRIPT = """
from async_rl.core.decoupled_ppo import (UPDATE_FORWARD, add_correction, apply_proximal_loss, apply_to_config,
                                         set_behaviour_as_old)
import async_rl.training.proximal_loss  # noqa: F401 (registers the loss)

recompute = demo_config(**{"actor_rollout_ref.actor.ppo_mini_batch_size": 16, "actor_rollout_ref.rollout.n": 1,
                           "actor_rollout_ref.actor.optim.lr": 0.0})
apply_to_config(recompute, cap=2.0)
update_forward = recompute.copy()
apply_proximal_loss(update_forward, UPDATE_FORWARD)
ray.init(**ray_init_kwargs(recompute))
batch = demo_batch()
shape = batch.batch["response_mask"].shape
batch.batch["advantages"] = torch.randn(shape, generator=torch.Generator().manual_seed(1))
noise = torch.randn(shape, generator=torch.Generator().manual_seed(2))

def train(cfg, name):
    group = make_worker_group(cfg, "actor", 1, name)
    data = batch.select_idxs(np.arange(len(batch)))
    prox = engine_calls.compute_log_prob(group, data, 1.0)
    data.batch["old_log_probs"] = prox  # the logp stage's pi_prox; replaced by the behaviour in the loss's mode
    data.batch["rollout_log_probs"] = prox + noise  # a behaviour policy off pi_prox: weights far from 1
    set_behaviour_as_old(data, cfg)
    data, _ = add_correction(data, cfg)
    capped = float(((prox - data.batch["rollout_log_probs"]).exp() > 2.0)[data.batch["response_mask"].bool()]
                   .float().mean())
    metrics = engine_calls.update_actor(group, data, cfg.actor_rollout_ref)
    return {"grad_norm": metrics["actor/grad_norm"], "pg_loss": metrics["actor/pg_loss"], "capped": capped}

done({"recompute": train(recompute, "recompute"), "update_forward": train(update_forward, "update_forward")})
"""


@pytest.mark.ray  # a Ray of its own
def test_the_updates_own_forward_as_pi_prox_trains_as_a_recomputed_pi_prox(demo_dir, tmp_path):
    result = run_on_workers(SCRIPT, demo_dir, tmp_path)
    recompute, update_forward = result["recompute"], result["update_forward"]
    assert recompute["capped"] > 0.05, result  # the cap drops tokens: the weights are exercised
    assert recompute["grad_norm"] > 0
    assert update_forward["grad_norm"] == pytest.approx(recompute["grad_norm"], rel=1e-5), result
    assert update_forward["pg_loss"] == pytest.approx(recompute["pg_loss"], rel=1e-5, abs=1e-7), result
