"""User stages (async_rl/core/stage_graph.py) and the example filter stage (examples/group_filter_stage.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from async_rl.core.config import read_async_config, strip_async_keys
from async_rl.core.errors import AsyncConfigError
from async_rl.core.messages import ScoredBatch
from async_rl.core.scoring import groups_with_distinct_rewards
from async_rl.core.stage_graph import UserStageSpec, build_edges, parse_user_stages, upstream_counts
from async_rl.run_config import load_stage_class
from examples.group_filter_stage import GroupFilterStage
from state_machines.actor_train import trainable_rows
from state_machines.base import END_OF_STREAM, StateMachine

FILTER_CLS = "examples.group_filter_stage.GroupFilterStage"


def stages_cfg(stages: dict):
    return OmegaConf.create({"trainer": {"total_epochs": 1, "async_stages": stages}})


# ---- config and graph ---------------------------------------------------------------


def test_two_config_lines_insert_a_stage_between_reward_and_actor_train():
    config = OmegaConf.from_dotlist(
        [f"trainer.async_stages.group_filter.cls={FILTER_CLS}", "trainer.async_stages.group_filter.after=reward"]
    )
    (spec,) = read_async_config(config).user_stages
    assert spec == UserStageSpec(name="group_filter", cls_path=FILTER_CLS, after="reward", kwargs={})
    assert load_stage_class(spec) is GroupFilterStage
    edges = build_edges((spec,))
    assert edges["reward"] == ("group_filter",)
    assert edges["group_filter"] == ("actor_train",)
    assert {k: v for k, v in edges.items() if k not in ("reward", "group_filter")} == {
        k: v for k, v in build_edges().items() if k != "reward"
    }
    assert upstream_counts(edges)["group_filter"] == 1
    assert upstream_counts(edges)["actor_train"] == 3  # reward's place is taken, not added to


def test_default_graph_counts_upstreams():
    counts = upstream_counts(build_edges())
    assert counts == {
        "dataloader": 0, "generate": 1, "rollout": 1, "reward": 1, "logp": 1, "ref_logp": 1,
        "actor_train": 3, "param_update": 1,
    }


def test_stages_insert_in_order_one_after_another():
    specs = parse_user_stages(
        {"a": {"cls": FILTER_CLS, "after": "reward"}, "b": {"cls": FILTER_CLS, "after": "a", "kwargs": {"min_std": 0.1}}}
    )
    edges = build_edges(specs)
    assert (edges["reward"], edges["a"], edges["b"]) == (("a",), ("b",), ("actor_train",))
    assert specs[1].kwargs == {"min_std": 0.1}


def test_stage_after_a_fan_out_stage_takes_all_its_downstreams():
    edges = build_edges(parse_user_stages({"tap": {"cls": FILTER_CLS, "after": "rollout"}}))
    assert edges["rollout"] == ("tap",) and edges["tap"] == ("reward", "logp", "ref_logp")


def test_a_stage_after_one_the_run_does_not_have_is_refused_naming_the_key():
    (spec,) = parse_user_stages({"f": {"cls": FILTER_CLS, "after": "values"}})  # values: with a critic only
    with pytest.raises(AsyncConfigError) as info:
        build_edges((spec,))
    assert info.value.key == "trainer.async_stages.f.after" and "a stage this run has" in str(info.value)
    assert build_edges((spec,), critic=True)["values"] == ("f",)


def test_stage_keys_are_stripped_before_verl_sees_the_config():
    config = stages_cfg({"f": {"cls": FILTER_CLS, "after": "reward"}})
    strip_async_keys(config)
    assert "async_stages" not in config.trainer


@pytest.mark.parametrize(
    "stages,key,fragment",
    [
        ({"reward": {"cls": FILTER_CLS, "after": "reward"}}, "trainer.async_stages.reward", "not already used"),
        ({"values": {"cls": FILTER_CLS, "after": "reward"}}, "trainer.async_stages.values", "not already used"),
        ({"clock": {"cls": FILTER_CLS, "after": "reward"}}, "trainer.async_stages.clock", "not already used"),
        ({"f": {"cls": FILTER_CLS, "after": "nowhere"}}, "trainer.async_stages.f.after", "one of"),
        ({"f": {"cls": FILTER_CLS, "after": "param_update"}}, "trainer.async_stages.f.after", "downstream"),
        ({"f": {"cls": FILTER_CLS}}, "trainer.async_stages.f.after", "one of"),
        ({"f": {"after": "reward"}}, "trainer.async_stages.f", "cls"),
        ({"f": {"cls": FILTER_CLS, "after": "reward", "kwarg": {}}}, "trainer.async_stages.f", "kwargs"),
        ({"f": {"cls": FILTER_CLS, "after": "reward", "kwargs": [1]}}, "trainer.async_stages.f.kwargs", "mapping"),
        ({"f": {"cls": FILTER_CLS, "after": "g"}, "g": {"cls": FILTER_CLS, "after": "reward"}},
         "trainer.async_stages.f.after", "one of"),
    ],
)
def test_bad_stage_entries_name_the_key(stages, key, fragment):
    with pytest.raises(AsyncConfigError) as info:
        read_async_config(stages_cfg(stages))
    assert info.value.key == key
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "path,fragment",
    [
        ("GroupFilterStage", "dotted path"),
        ("examples.no_such_module.Stage", "importable module"),
        ("examples.group_filter_stage.NoSuchStage", "subclass of state_machines.base.StateMachine"),
        ("async_rl.core.scoring.groups_with_distinct_rewards", "subclass"),
    ],
)
def test_bad_stage_class_fails_with_the_key(path, fragment):
    (spec,) = parse_user_stages({"f": {"cls": path, "after": "reward"}})
    with pytest.raises(AsyncConfigError) as info:
        load_stage_class(spec)
    assert info.value.key == "trainer.async_stages.f.cls"
    assert fragment in str(info.value)


# ---- the example filter -----------------------------------------------------------------


def test_groups_with_distinct_rewards_keeps_only_mixed_groups():
    uids = np.array(["a", "a", "b", "b", "c", "c", "d"], dtype=object)
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    keep = groups_with_distinct_rewards(uids, scores)
    assert keep.tolist() == [False, False, True, True, False, False, True]  # a, c uniform; d alone: kept, as verl
    assert groups_with_distinct_rewards(uids, torch.tensor([0, 0.1, 0, 1, 0, 0, 0.5]), min_std=0.2).tolist() == [
        False, False, True, True, False, False, True,
    ]


@pytest.mark.parametrize(
    "kept,mini,dp,group,expected",
    [(64, 64, 2, 8, 64), (80, 64, 2, 8, 64), (40, 64, 2, 8, 40), (30, 64, 4, 6, 24), (8, 64, 2, 8, 8), (4, 64, 8, 4, 0)],
)
def test_trainable_rows(kept, mini, dp, group, expected):
    rows = trainable_rows(kept, mini, dp, group)
    assert rows == expected
    assert rows % dp == 0 and (rows >= mini and rows % mini == 0 or rows < mini and rows % group == 0)


class _Feed(StateMachine):
    def __init__(self, items):
        super().__init__("feed")
        self.items = list(items)

    async def get_input_data(self):
        return self.items.pop(0) if self.items else END_OF_STREAM

    async def process_data(self, data):
        return data

    async def send_output_data(self, data):
        return await self.send_downstream(data)


class _Collect(StateMachine):
    def __init__(self):
        super().__init__("collect")
        self.got = []

    async def get_input_data(self):
        return await self.next_from_inbox()

    async def process_data(self, data):
        self.got.append(data)

    async def send_output_data(self, data):
        return True


def test_filter_stage_runs_in_a_pipeline_and_marks_rows():
    uids = np.array(["p", "p", "q", "q"], dtype=object)
    batches = [
        ScoredBatch(index=0, scores=torch.tensor([1.0, 0.0, 1.0, 1.0]), uids=uids),
        ScoredBatch(index=1, scores=torch.tensor([0.0, 0.0, 1.0, 1.0]), uids=uids),
    ]
    feed, flt, sink = _Feed(batches), GroupFilterStage(config=None, name="group_filter"), _Collect()
    feed.connect([flt], 0)
    flt.connect([sink], 1)
    sink.connect([], 1)

    async def main():
        await asyncio.wait_for(asyncio.gather(feed.run(), flt.run(), sink.run()), timeout=10)

    asyncio.run(main())
    assert [b.index for b in sink.got] == [0, 1]
    assert sink.got[0].keep.tolist() == [True, True, False, False]
    assert sink.got[0].metrics == {"async/group_filter/kept_groups": 1.0, "async/group_filter/kept_ratio": 0.5}
    assert sink.got[1].keep.tolist() == [False] * 4
    assert sink.got[1].metrics["async/group_filter/kept_ratio"] == 0.0


def test_verls_filter_groups_key_turns_on_dynamic_sampling_after_reward():
    from omegaconf import OmegaConf

    from async_rl.core.config import read_async_config
    from async_rl.core.errors import AsyncConfigError

    on = OmegaConf.create({"algorithm": {"filter_groups": {"enable": True, "metric": "acc", "max_num_gen_batches": 4}}})
    assert read_async_config(on).dynamic_sampling is True
    edges = build_edges((), dynamic_sampling=True)
    assert edges["rollout"] == ("reward",) and edges["reward"] == ("dynamic_sampling",)
    assert edges["dynamic_sampling"] == ("logp", "ref_logp", "actor_train")
    assert upstream_counts(edges)["actor_train"] == 3 and upstream_counts(edges)["logp"] == 1
    spec = UserStageSpec("group_filter", "examples.group_filter_stage.GroupFilterStage", "reward")
    assert build_edges((spec,), dynamic_sampling=True)["reward"] == ("group_filter",)  # user stages go before it
    assert read_async_config(OmegaConf.create({"algorithm": {"filter_groups": {"enable": False}}})).dynamic_sampling is False
    for key, bad in (("metric", "kl"), ("max_num_gen_batches", -1)):
        config = OmegaConf.create({"algorithm": {"filter_groups": {"enable": True, key: bad}}})
        with pytest.raises(AsyncConfigError, match=f"algorithm.filter_groups.{key}"):
            read_async_config(config)
