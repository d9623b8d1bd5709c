"""Which stage feeds which: the graph of the built-in stages a run has, and user stages inserted into it.

The built-in stages and their inputs are the rows of async_rl/core/stage_table.py; a run has
some of them (values and critic_train with a critic, dynamic_sampling with DAPO's dynamic
sampling). A user stage is added with two lines of config and lands on the edge after an
existing stage:

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
from async_rl.core.stage_table import CLOCK, STAGES, RunShape, stages_of

STAGES_KEY = "trainer.async_stages"  # the config key of the user stages
BUILTIN_STAGES = tuple(spec.name for spec in STAGES)  # names a user stage may not take
SIDE_EDGES = {spec.name: spec.side_input for spec in STAGES if spec.side_input}  # stage -> its upstream outside the edges
# stages with no downstream, whatever the run: a user stage cannot go after them
ENDS = frozenset(spec.name for spec in STAGES) - {name for spec in STAGES for entry in spec.inputs
                                                    for name in (entry if isinstance(entry, tuple) else (entry,))}


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
        if name in known or name == CLOCK:
            raise AsyncConfigError(key, name, f"a name not already used by a stage ({sorted(known | {CLOCK})})")
        if not isinstance(entry, dict) or set(entry) - {"cls", "after", "kwargs"} or "cls" not in entry:
            raise AsyncConfigError(key, entry, "{cls: package.module.Class, after: <stage>, kwargs: {...} (optional)}")
        after = entry.get("after")
        if after not in known or after in ENDS:
            allowed = sorted(known - ENDS)
            raise AsyncConfigError(f"{key}.after", after, f"a stage with a downstream, one of {allowed}")
        kwargs = entry.get("kwargs") or {}
        if not isinstance(kwargs, dict):
            raise AsyncConfigError(f"{key}.kwargs", kwargs, "a mapping of constructor keyword arguments")
        if not isinstance(entry["cls"], str):
            raise AsyncConfigError(f"{key}.cls", entry["cls"], "a dotted path 'package.module.Class'")
        specs.append(UserStageSpec(name=name, cls_path=entry["cls"], after=after, kwargs=dict(kwargs)))
        known.add(name)
    return tuple(specs)


def build_edges(user_stages: tuple[UserStageSpec, ...] = (), dynamic_sampling: bool = False,
                critic: bool = False) -> dict[str, tuple[str, ...]]:
    """The stage graph (name -> downstream names, in table order, then the user stages) of a run with
    a critic or not and dynamic sampling (verl's `algorithm.filter_groups.enable`) or not, each user
    stage on the edge after its `after`; AsyncConfigError when that stage is not in this run."""
    specs = stages_of(RunShape(critic=critic, dynamic_sampling=dynamic_sampling))
    names = [spec.name for spec in specs]
    edges: dict[str, list[str]] = {name: [] for name in names}
    for spec in specs:
        for entry in spec.inputs:
            source = next((n for n in (entry if isinstance(entry, tuple) else (entry,)) if n in edges), None)
            if source is not None:
                edges[source].append(spec.name)
    graph = {name: tuple(downstream) for name, downstream in edges.items()}
    for spec in user_stages:
        if spec.after not in graph:
            raise AsyncConfigError(f"{STAGES_KEY}.{spec.name}.after", spec.after,
                                   f"a stage this run has, one of {sorted(n for n in graph if n not in ENDS)}")
        graph[spec.name] = graph[spec.after]
        graph[spec.after] = (spec.name,)
    return graph


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
