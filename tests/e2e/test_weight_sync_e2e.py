"""End to end: after training through the pipeline, the trainer's FSDP2 shards, the logp
workers' shards and every rollout server hold bit-identical weights (per-tensor digests).

Two train ranks and two logp ranks (sharded; `algorithm.proximal_logp_workers=logp`), two rollout servers, the single-buffer mode
and buckets smaller than most tensors: the paths the other end-to-end runs do not take.
"""

from __future__ import annotations

from helpers.runs import run_pipeline_reading_digests


def test_every_receiver_holds_the_trainers_bytes(demo_dir, tmp_path, ray_address):
    extra = {
        "trainer.n_gpus_per_node": 4,
        "trainer.total_training_steps": 3,
        "trainer.test_freq": -1,
        "trainer.val_before_train": False,
        "+algorithm.proximal_logp_workers": "logp",  # pi_prox on the logp stage's own ranks: a receiver
        "+actor_rollout_ref.rollout.enable_dual_buffer": False,
        "+actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb": 0.01,  # 10 KB: tensors span buckets
        "+actor_rollout_ref.rollout.param_update_consume_bucket_size_mb": 0.005,
    }
    proc, result = run_pipeline_reading_digests(demo_dir, extra, tmp_path, env={"RAY_ADDRESS": ray_address})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    digests = result["digests"]
    assert set(digests) == {"actor_train", "logp", "rollout_server_0", "rollout_server_1"}
    trainer = digests["actor_train"]
    assert len(trainer) > 10
    for receiver, held in digests.items():
        assert held == trainer, f"{receiver} differs from the trainer"
    steps = result["steps"]
    assert [s["training/global_step"] for s in steps] == [1, 2, 3]
    for step in steps:  # the logp stage computed pi_prox with the trainer's pre-update version
        assert step["async/logp_version"] == step["training/global_step"] - 1
        assert "timing_s/old_log_prob" not in step  # not on the train ranks
    assert max(step["async/logp/busy_ratio"] for step in steps) > 0
    last = steps[-1]
    assert last["async/param_update/num_buckets"] > 10  # many buckets per version
    assert last["async/param_update/synced_version"] >= 2
    # one Ray node: both servers and the logp stage read the trainer's shared memory, nothing went through the store
    assert (last["async/param_update/shm_receivers"], last["async/param_update/store_receivers"]) == (3, 0)
