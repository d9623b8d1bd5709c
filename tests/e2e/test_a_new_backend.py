"""The rollout-backend contract (async_rl/api/rollout.py) proven by extension: a backend written in one
file outside the package (tests/e2e/echo_backend.py: one row, one registration) runs the pipeline end to
end. Its servers start on random weights, so step 1 is on-policy only if the pipeline served version 0
first (`starts_on_dummy_weights`); its receivers take the object store (`receivers_tell_nodes` off)."""

from __future__ import annotations

import os

from helpers.runs import run_pipeline_reading_digests


def test_a_backend_registered_from_outside_trains_on_policy(demo_dir, tmp_path, ray_address):
    extra = {"actor_rollout_ref.rollout.name": "echo", "trainer.n_gpus_per_node": 4,
             "trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "+trainer.generate_ahead_steps": 1}
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           "RAY_ADDRESS": ray_address}
    proc, result = run_pipeline_reading_digests(demo_dir, extra, tmp_path, env=env, imports=("echo_backend",))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    digests = result["digests"]
    assert set(digests) == {"actor_train", "echo_replica_0", "echo_replica_1"}
    assert digests["echo_replica_0"] == digests["echo_replica_1"] == digests["actor_train"]
    steps = result["steps"]
    assert [s["training/global_step"] for s in steps] == [1, 2]
    for step in steps:  # k=1: every response sampled by the weights the trainer computes pi_prox with
        assert step["rollout_corr/log_ppl_abs_diff"] < 1e-4, step["rollout_corr/log_ppl_abs_diff"]
        assert (step["async/param_update/shm_receivers"], step["async/param_update/store_receivers"]) == (0, 2)
