"""async_rl/core/stage_table.py: one row per built-in stage. The graph its rows make, the order they are
built in, the parts actor_train joins, and every row's kwargs against its class's constructor."""

from __future__ import annotations

import inspect

import pytest

from async_rl.build import stage_class
from async_rl.core.messages import LogpResult, RefLogpResult, ScoredBatch, TrainingBatch, ValuesResult
from async_rl.core.placement import TRAINING_ROLES
from async_rl.core.stage_graph import build_edges, upstream_counts
from async_rl.core.stage_table import BY_NAME, JOIN_PARTS, STAGES, RunShape, build_order, stages_of, step_parts
from state_machines.actor_train import step_part
from state_machines.base import StateMachine

SHAPES = [RunShape(critic=c, dynamic_sampling=d) for c in (False, True) for d in (False, True)]


def test_the_rows_make_the_pipelines_graph():
    assert build_edges() == {
        "dataloader": ("generate",), "generate": ("rollout",), "rollout": ("reward", "logp", "ref_logp"),
        "reward": ("actor_train",), "logp": ("actor_train",), "ref_logp": ("actor_train",),
        "param_update": (), "actor_train": ("param_update",),
    }
    dapo_ppo = build_edges(dynamic_sampling=True, critic=True)
    assert dapo_ppo["rollout"] == ("reward",) and dapo_ppo["reward"] == ("dynamic_sampling",)
    assert dapo_ppo["dynamic_sampling"] == ("logp", "ref_logp", "values", "actor_train")
    assert dapo_ppo["values"] == ("actor_train",) and dapo_ppo["critic_train"] == ()
    assert upstream_counts(dapo_ppo)["critic_train"] == 1  # actor_train's direct calls (its side input)


class Anything:
    """Stands in for every value a row's kwargs read from the build's inputs."""

    def __getattr__(self, name):
        return self

    def __getitem__(self, key):
        return self

    def __call__(self, *args, **kwargs):
        return self

    def __int__(self):
        return 1

    def __float__(self):
        return 1.0

    def __lt__(self, other):
        return False

    __gt__ = __le__ = __ge__ = __lt__


@pytest.mark.parametrize("spec", STAGES, ids=[s.name for s in STAGES])
def test_every_row_builds_its_class_with_keyword_arguments_only(spec):
    cls = stage_class(spec.cls)
    assert issubclass(cls, StateMachine)
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), params
    inspect.signature(cls).bind(**spec.kwargs(Anything()))  # every argument it gives is one the class takes


def test_placement_roles_needs_and_join_parts_name_what_exists():
    for spec in STAGES:
        assert spec.role in (None, "generate", *TRAINING_ROLES), spec.name
        assert set(spec.needs) <= set(BY_NAME), spec.name
    assert JOIN_PARTS == {ScoredBatch: "reward", TrainingBatch: "reward", LogpResult: "logp",
                          RefLogpResult: "ref_logp", ValuesResult: "values"}
    assert step_parts(build_edges()) == ("reward", "logp", "ref_logp")
    assert step_parts(build_edges(dynamic_sampling=True, critic=True)) == ("reward", "logp", "ref_logp", "values")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_each_stage_is_built_after_the_stages_it_takes_handles_of(shape):
    order = [s.name for s in build_order(stages_of(shape))]
    assert sorted(order) == sorted(s.name for s in stages_of(shape))
    for spec in stages_of(shape):
        assert all(order.index(n) < order.index(spec.name) for n in spec.needs if n in order), (spec.name, order)


def test_a_formed_training_batch_joins_as_the_reward_part():
    scored = ScoredBatch(index=0, scores=None, uids=None)
    assert step_part(scored) == ("reward", scored)
    assert step_part(TrainingBatch(index=0, batch_ref=None, start_version=0, scored=scored)) == ("reward", scored)
