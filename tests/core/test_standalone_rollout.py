"""verl's standalone rollout nodes under the flag (`actor_rollout_ref.rollout.nnodes` > 0, as verl's separate-async
trainer sets them): generation on `rollout.nnodes` nodes of its own after the `trainer.nnodes` training nodes, placed
exactly as the same job written with `+trainer.use_nodes_ratios`; what cannot be placed is refused naming the key."""

from __future__ import annotations

import itertools

import pytest

from async_rl.core.errors import AsyncConfigError
from async_rl.core.placement import plan_placement, standalone_rollout_ratios
from async_rl.core.verl_async_keys import job_nodes
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo

RATIOS = "+trainer.use_nodes_ratios"


def run_config(demo_dir, extra: dict, ratios: str | None = None):
    from async_rl.demo import demo_overrides

    overrides = [o for o in demo_overrides(demo_dir, extra=extra) if not o.startswith(RATIOS + "=")]
    return read_run_config(compose_ppo(overrides + ([f"{RATIOS}={ratios}"] if ratios else [])))


@pytest.mark.parametrize("trainer_nodes,rollout_nodes,per_node", itertools.product((1, 2, 3, 7), (1, 2, 15), (1, 2, 8)))
def test_generate_takes_the_rollout_nodes_and_training_the_trainers(trainer_nodes, rollout_nodes, per_node):
    ratios = dict(zip(("train", "logp", "ref_logp", "generate"), standalone_rollout_ratios(trainer_nodes, rollout_nodes)))
    placement = plan_placement(trainer_nodes + rollout_nodes, per_node, {**ratios, "critic": ratios["train"]},
                               ["train", "critic", "ref_logp"], replica_devices=1)
    first_rollout_device = trainer_nodes * per_node
    assert [r.start for r in placement.replicas] == list(range(first_rollout_device, (trainer_nodes + rollout_nodes) * per_node))
    assert all((g.start, g.count) == (0, first_rollout_device) for g in placement.groups.values())  # shared


def test_a_standalone_rollout_node_places_the_job_as_the_same_ratios_do(demo_dir):
    standalone = run_config(demo_dir, {"actor_rollout_ref.rollout.nnodes": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 2})
    written = run_config(demo_dir, {"trainer.nnodes": 2}, ratios="[0.5,0.5,0.5,0.5]")
    assert standalone.placement == written.placement
    assert standalone.placement.describe() == "node 0: train x2; node 1: generate x2 replica(s)"
    assert standalone.async_cfg.use_nodes_ratios == (0.5, 0.5, 0.5, 0.5)
    assert job_nodes(standalone.config) == 2  # Ray's logical GPUs on CPU count both pools' devices


def test_a_rollout_node_of_another_size_or_ratios_set_too_are_refused_naming_the_key(demo_dir):
    with pytest.raises(AsyncConfigError, match=r"rollout\.n_gpus_per_node=4; allowed: trainer\.n_gpus_per_node's 2"):
        run_config(demo_dir, {"actor_rollout_ref.rollout.nnodes": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 4})
    with pytest.raises(AsyncConfigError, match=r"rollout\.nnodes=1; allowed: 0 with \+trainer\.use_nodes_ratios"):
        run_config(demo_dir, {"actor_rollout_ref.rollout.nnodes": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 2},
                   ratios="[0.5,0.5,0.5,0.5]")
