"""`+algorithm.proximal_logp_method=update_forward` on verl's real FSDP2 engine worker: the update's own forward
as pi_prox gives the loss and gradient a recomputed pi_prox gives (verl's forward pass, then verl's importance
weights), for one batch whose behaviour policy is far enough from pi_prox that the cap drops tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np, ray, torch, verl
    from hydra import compose, initialize_config_dir
    from async_rl.core.decoupled_ppo import (UPDATE_FORWARD, add_correction, apply_proximal_loss, apply_to_config,
                                             set_behaviour_as_old)
    from async_rl.demo import demo_overrides
    from async_rl.run_config import ray_init_kwargs
    from async_rl.training import engine_calls
    from async_rl.training.worker_groups import make_worker_group
    import async_rl.training.proximal_loss  # noqa: F401 (registers the loss)
    sys.path.insert(0, sys.argv[3])
    from test_balance import skewed_batch

    demo_dir, out_path = sys.argv[1], sys.argv[2]
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        recompute = compose("ppo_trainer", overrides=demo_overrides(demo_dir, extra={
            "actor_rollout_ref.actor.ppo_mini_batch_size": 16, "actor_rollout_ref.rollout.n": 1,
            "actor_rollout_ref.actor.optim.lr": 0.0}))
    apply_to_config(recompute, cap=2.0)
    update_forward = recompute.copy()
    apply_proximal_loss(update_forward, UPDATE_FORWARD)
    ray.init(**ray_init_kwargs(recompute))
    from transformers import AutoConfig
    batch = skewed_batch(vocab=AutoConfig.from_pretrained(os.path.join(demo_dir, "model")).vocab_size)
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

    result = {"recompute": train(recompute, "recompute"), "update_forward": train(update_forward, "update_forward")}
    ray.shutdown()
    json.dump(result, open(out_path, "w"))
    """
)


@pytest.mark.ray  # a Ray of its own
def test_the_updates_own_forward_as_pi_prox_trains_as_a_recomputed_pi_prox(demo_dir, tmp_path):
    out = tmp_path / "result.json"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(demo_dir), str(out), here],
        cwd=tmp_path, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    recompute, update_forward = result["recompute"], result["update_forward"]
    assert recompute["capped"] > 0.05, result  # the cap drops tokens: the weights are exercised
    assert recompute["grad_norm"] > 0
    assert update_forward["grad_norm"] == pytest.approx(recompute["grad_norm"], rel=1e-5), result
    assert update_forward["pg_loss"] == pytest.approx(recompute["pg_loss"], rel=1e-5, abs=1e-7), result
