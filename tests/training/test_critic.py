"""The critic: verl's critic worker driven by the values and critic_train stages (real FSDP2 rank)."""

from __future__ import annotations

import pytest

from async_rl.core.stage_graph import SIDE_EDGES, build_edges, parse_user_stages, upstream_counts
from helpers.engine_workers import run_on_workers

CRITIC_SCRIPT = """
from async_rl.core.config import strip_async_keys
from async_rl.training.worker_groups import make_critic_worker_group
from verl.trainer.ppo.core_algos import compute_value_loss

config = demo_config(critic=True, **{
    "actor_rollout_ref.rollout.n": 1, "critic.ppo_mini_batch_size": 16, "critic.ppo_epochs": 1,
    "critic.cliprange_value": 0.5, "critic.optim.lr": 1e-4})
strip_async_keys(config)
ray.init(**ray_init_kwargs(config))
batch = demo_batch()
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
done({"metrics": metrics, "verl_vf_loss": float(loss), "verl_vf_clipfrac": float(clipfrac),
      "vpred_mean": float((values * mask).sum() / mask.sum()), "mse_before": mse(values), "mse_after": mse(after),
      "step_toward_returns": float(((after - values) * (batch.batch["returns"] - values) * mask).sum()),
      "masked_values_finite": bool(torch.isfinite(values[mask.bool()]).all())})
"""


@pytest.mark.ray  # a Ray of its own
def test_critic_update_loss_is_verls_value_loss_and_the_update_fits_the_returns(demo_dir, tmp_path):
    """verl's critic worker on one real FSDP2 rank: the values stage's forward, then critic_train's
    update; the loss verl's worker reports equals verl's compute_value_loss on the same batch, and the
    update moves the values toward the returns."""
    result = run_on_workers(CRITIC_SCRIPT, demo_dir, tmp_path)
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
