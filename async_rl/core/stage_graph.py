"""Which stage feeds which: the built-in graph and user stages inserted into it.

The eight built-in stages form a fixed graph (`BUILTIN_EDGES`). A user stage is added
with two lines of config and lands on the edge after an existing stage:

    +trainer.async_stages.group_filter.cls=examples.group_filter_stage.GroupFilterStage
    +trainer.async_stages.group_filter.after=reward

turns `reward -> actor_train` into `reward -> group_filter -> actor_train`. Optional
`kwargs` (a dict) go to the stage's constructor: `cls(config=<verl config>, name=<name>,
**kwargs)`. Stages are inserted in the order given, so one may go after another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_rl.core.errors import AsyncConfigError

STAGES_KEY = "trainer.async_stages"  # the config key of the user stages
BUILTIN_STAGES = ("dataloader", "generate", "rollout", "reward", "logp", "ref_logp", "actor_train", "param_update")
BUILTIN_EDGES: dict[str, tuple[str, ...]] = {
    "dataloader": ("generate",),
    "generate": ("rollout",),
    "rollout": ("reward", "logp", "ref_logp"),
    "reward": ("actor_train",),
    "logp": ("actor_train",),
    "ref_logp": ("actor_train",),
    "actor_train": ("param_update",),
    "param_update": (),
}


@dataclass(frozen=True)
class UserStageSpec:
    """A user stage from `trainer.async_stages.<name>`: its class path, position and kwargs."""

    name: str
    cls_path: str
    after: str
    kwargs: dict[str, Any] = field(default_factory=dict)


def parse_user_stages(raw: Any) -> tuple[UserStageSpec, ...]:
    """`trainer.async_stages` (a dict name -> {cls, after, kwargs}) -> specs, validated.

    Checks names, keys and positions; the classes are imported by `async_rl.run_config.load_stage_class`.
    """
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise AsyncConfigError(STAGES_KEY, raw, "a mapping <stage name> -> {cls: package.module.Class, after: <stage>}")
    specs: list[UserStageSpec] = []
    known = set(BUILTIN_STAGES)
    for name, entry in raw.items():
        key = f"{STAGES_KEY}.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            raise AsyncConfigError(key, name, "a stage name that is a Python identifier")
        if name in known:
            raise AsyncConfigError(key, name, f"a name not already used by a stage ({sorted(known)})")
        if not isinstance(entry, dict) or set(entry) - {"cls", "after", "kwargs"} or "cls" not in entry:
            raise AsyncConfigError(key, entry, "{cls: package.module.Class, after: <stage>, kwargs: {...} (optional)}")
        after = entry.get("after")
        if after not in known or after == "param_update":
            allowed = sorted(known - {"param_update"})
            raise AsyncConfigError(f"{key}.after", after, f"a stage with a downstream, one of {allowed}")
        kwargs = entry.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise AsyncConfigError(f"{key}.kwargs", kwargs, "a mapping of constructor keyword arguments")
        if not isinstance(entry["cls"], str):
            raise AsyncConfigError(f"{key}.cls", entry["cls"], "a dotted path 'package.module.Class'")
        specs.append(UserStageSpec(name=name, cls_path=entry["cls"], after=after, kwargs=dict(kwargs)))
        known.add(name)
    return tuple(specs)


DYNAMIC_SAMPLING = "dynamic_sampling"
# With a critic (PPO with GAE): values runs beside logp and ref_logp, and actor_train hands each
# step's rows to critic_train directly (it sends weights, not batches, down its graph edge).
VALUES, CRITIC_TRAIN = "values", "critic_train"
SIDE_EDGES = {CRITIC_TRAIN: "actor_train"}  # stage -> its upstream outside the graph's edges


def build_edges(user_stages: tuple[UserStageSpec, ...] = (), dynamic_sampling: bool = False,
                critic: bool = False) -> dict[str, tuple[str, ...]]:
    """The stage graph (name -> downstream names) with each user stage on the edge after its `after`.

    `dynamic_sampling` (verl's `algorithm.filter_groups.enable`): training batches are formed
    after reward, so reward feeds the dynamic_sampling stage, which feeds logp, ref_logp and
    actor_train (state_machines/dynamic_sampling.py). `critic`: the values stage sits beside
    logp and ref_logp, and critic_train is fed by actor_train (`SIDE_EDGES`).
    """
    edges = dict(BUILTIN_EDGES)
    if dynamic_sampling:
        edges["rollout"] = ("reward",)
        edges["reward"] = (DYNAMIC_SAMPLING,)
        edges[DYNAMIC_SAMPLING] = ("logp", "ref_logp", "actor_train")
    if critic:
        fan_out = DYNAMIC_SAMPLING if dynamic_sampling else "rollout"
        edges[fan_out] = (*edges[fan_out], VALUES)
        edges[VALUES] = ("actor_train",)
        edges[CRITIC_TRAIN] = ()
    for spec in user_stages:
        edges[spec.name] = edges[spec.after]
        edges[spec.after] = (spec.name,)
    return edges


def upstream_counts(edges: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """How many upstreams each stage waits on for END_OF_STREAM (graph edges and `SIDE_EDGES`)."""
    counts = {name: 0 for name in edges}
    for downstream in edges.values():
        for name in downstream:
            counts[name] += 1
    for name in SIDE_EDGES:
        if name in counts:
            counts[name] += 1
    return counts
