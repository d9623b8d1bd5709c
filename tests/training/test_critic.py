"""The critic: verl's critic worker driven by the values and critic_train stages (real FSDP2 rank)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from async_rl.core.stage_graph import SIDE_EDGES, build_edges, parse_user_stages, upstream_counts

CRITIC_SCRIPT = """
import json, os, sys
import ray, torch, verl
from hydra import compose, initialize_config_dir
from async_rl.training import engine_calls
from async_rl.core.config import strip_async_keys
from async_rl.demo import demo_overrides
from async_rl.training.worker_groups import make_critic_worker_group
from async_rl.run_config import ray_init_kwargs
from verl.trainer.ppo.core_algos import compute_value_loss
sys.path.insert(0, sys.argv[3])
from test_balance import skewed_batch
demo_dir, out_dir = sys.argv[1], sys.argv[2]
with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
    config = compose("ppo_trainer", overrides=demo_overrides(demo_dir, critic=True, extra={
        "actor_rollout_ref.rollout.n": 1, "critic.ppo_mini_batch_size": 16, "critic.ppo_epochs": 1,
        "critic.cliprange_value": 0.5, "critic.optim.lr": 1e-4}))
strip_async_keys(config)
ray.init(**ray_init_kwargs(config))
from transformers import AutoConfig
batch = skewed_batch(vocab=AutoConfig.from_pretrained(os.path.join(demo_dir, "model")).vocab_size)
mask = batch.batch["response_mask"]
batch.batch["returns"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
group = make_critic_worker_group(config, 1)
values = engine_calls.compute_values(group, batch, 1.0)
batch.batch["values"] = values
metrics = engine_calls.update_critic(group, batch, config)
after = engine_calls.compute_values(group, batch, 1.0)
# verl's value loss of this batch at the update's first (only) optimizer step: the predictions are the values
loss, clipfrac = compute_value_loss(vpreds=values, values=values, returns=batch.batch["returns"],
                                    response_mask=mask.bool(), cliprange_value=0.5, loss_agg_mode="token-mean")
def mse(v):
    return float((((v - batch.batch["returns"]) ** 2) * mask).sum() / mask.sum())
json.dump({"metrics": metrics, "verl_vf_loss": float(loss), "verl_vf_clipfrac": float(clipfrac),
           "vpred_mean": float((values * mask).sum() / mask.sum()), "mse_before": mse(values), "mse_after": mse(after),
           "step_toward_returns": float(((after - values) * (batch.batch["returns"] - values) * mask).sum()),
           "masked_values_finite": bool(torch.isfinite(values[mask.bool()]).all())},
          open(os.path.join(out_dir, "result.json"), "w"))
ray.shutdown()
"""


@pytest.mark.ray  # a Ray of its own
def test_critic_update_loss_is_verls_value_loss_and_the_update_fits_the_returns(demo_dir, tmp_path):
    """verl's critic worker on one real FSDP2 rank: the values stage's forward, then critic_train's
    update; the loss verl's worker reports equals verl's compute_value_loss on the same batch, and the
    update moves the values toward the returns."""
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", CRITIC_SCRIPT, str(demo_dir), str(tmp_path), here], cwd=tmp_path,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    metrics = result["metrics"]
    assert result["masked_values_finite"]
    assert metrics["critic/vf_loss"] == pytest.approx(result["verl_vf_loss"], rel=1e-4)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(result["verl_vf_clipfrac"]) == 0.0
    assert metrics["critic/vpred_mean"] == pytest.approx(result["vpred_mean"], rel=1e-4, abs=1e-6)
    assert metrics["critic/grad_norm"] > 0 and "perf/mfu/critic" in metrics and "critic/lr" in metrics
    # one Adam step at a small lr (the demo's 1e-3 can overshoot random returns in one step): the values
    # move toward the returns, and the squared error falls
    assert result["step_toward_returns"] > 0 and result["mse_after"] < result["mse_before"], result


def test_the_values_stage_sits_beside_logp_and_critic_train_is_fed_by_actor_train():
    edges = build_edges(critic=True)
    assert set(edges["rollout"]) == {"reward", "logp", "ref_logp", "values"}
    assert edges["values"] == ("actor_train",) and edges["critic_train"] == ()
    counts = upstream_counts(edges)
    assert counts["actor_train"] == 4 and counts["critic_train"] == 1 and SIDE_EDGES == {"critic_train": "actor_train"}
    assert "values" not in build_edges() and "critic_train" not in upstream_counts(build_edges())
    # dynamic sampling forms the batches first; a user stage after reward keeps the values stage
    assert set(build_edges(dynamic_sampling=True, critic=True)["dynamic_sampling"]) == {
        "logp", "ref_logp", "actor_train", "values"}
    user = parse_user_stages({"group_filter": {"cls": "examples.group_filter_stage.GroupFilterStage", "after": "reward"}})
    with_user = build_edges(user, critic=True)
    assert with_user["reward"] == ("group_filter",) and with_user["group_filter"] == ("actor_train",)
    assert upstream_counts(with_user)["actor_train"] == 4
