"""Name a run's bottleneck in one sentence from its stages' busy ratios (fraction of the run's time,
0..1, each stage busy with at least one item: `async/<stage>/busy_ratio` or the timeline's work spans).

The pipeline's step is paced by its busiest stage: bubble ratio = 1 / that stage's busy ratio
(1.0: the slowest stage never waits). `BUBBLE_GOAL` is the ratio above which the busiest stage is
said to wait on the others rather than to be the bottleneck itself.
"""

from __future__ import annotations

from collections.abc import Mapping

from async_rl.core.placement import RATIOS_KEY

BUBBLE_GOAL = 1.15
CHAIN_BUSY = 0.8  # actor_train + logp busy together at least this: they take turns
IDLE_FLOOR = 0.01  # a stage less busy than this has no work (e.g. logp with pi_prox on the train ranks)
STAGE_ROLE = {"actor_train": "train", "logp": "logp", "ref_logp": "ref_logp", "critic_train": "critic",
              "values": "critic", "generate": "generate"}  # stage -> the devices it runs on (use_nodes_ratios)
WHAT_IT_DOES = {"generate": "generation", "actor_train": "training", "logp": "the pi_prox pass",
                "ref_logp": "the reference log-probs", "critic_train": "critic training",
                "values": "the critic's values", "reward": "scoring", "rollout": "rollout assembly",
                "dataloader": "data loading", "param_update": "the weight sync"}


def busiest_stage(busy: Mapping[str, float]) -> str:
    """The stage with the largest busy ratio (ValueError when `busy` is empty)."""
    if not busy:
        raise ValueError("no stage busy ratios to compare")
    return max(busy, key=busy.get)


def structural_cause(busy: Mapping[str, float], ahead: int) -> str | None:
    """A schedule that makes the busiest stage wait whatever the devices (generate_ahead_steps=1, or
    actor_train and logp taking turns), when its bubble ratio is above BUBBLE_GOAL; else None."""
    busiest = busiest_stage(busy)
    if busy[busiest] <= 0 or 1.0 / busy[busiest] <= BUBBLE_GOAL:
        return None
    chain = busy.get("actor_train", 0.0) + busy.get("logp", 0.0)
    if busy.get("logp", 0.0) > 0.05 and chain > CHAIN_BUSY:
        return (f"actor_train and logp take turns (busy together {chain:.2f}): pi_prox of batch j needs the "
                "weights of step j - 1; +algorithm.proximal_logp_workers=train computes it on the train ranks instead")
    if ahead == 1:
        return ("generate_ahead_steps=1 is synchronous: generation of batch j + 1 waits for "
                f"update j, so {busiest} idles while generation runs; k >= 2 overlaps them")
    return None


def _next_busiest(busy: Mapping[str, float], busiest: str) -> str:
    others = sorted(((s, b) for s, b in busy.items() if s != busiest), key=lambda x: -x[1])[:3]
    return ", ".join(f"{s} {b:.2f}" for s, b in others)


def waiting_cause(busy: Mapping[str, float], ahead: int) -> str | None:
    """Why the busiest stage waits (its bubble ratio is above BUBBLE_GOAL), or None when it does not."""
    busiest = busiest_stage(busy)
    if busy[busiest] <= 0 or 1.0 / busy[busiest] <= BUBBLE_GOAL:
        return None
    return structural_cause(busy, ahead) or (
        f"{busiest} (busy {busy[busiest]:.2f}) waits on its upstream stages: {_next_busiest(busy, busiest)}")


def bottleneck_sentence(busy: Mapping[str, float], ahead: int) -> str:
    """One sentence: the slowest stage, how busy, at which generate_ahead_steps, and what would help
    (a schedule that makes it wait whatever the devices comes first)."""
    busiest = busiest_stage(busy)
    cause = structural_cause(busy, ahead)
    if cause is not None:
        return f"the busiest stage waits: {cause}"
    what, role = WHAT_IT_DOES.get(busiest, busiest), STAGE_ROLE.get(busiest)
    head = f"{what} is the slowest stage: {busiest} {busy[busiest]:.0%} busy at k={ahead}"
    if role is not None:
        idle = sorted(((STAGE_ROLE[s], b) for s, b in busy.items()  # under 1%: a stage without work or devices
                       if STAGE_ROLE.get(s) not in (None, role) and b >= IDLE_FLOOR), key=lambda x: x[1])
        spare = f" (the {idle[0][0]} devices are {idle[0][1]:.0%} busy)" if idle else ""
        advice = f"more {role} devices{spare} would shorten the step: +{RATIOS_KEY}"
    else:
        advice = "it runs on no devices of its own: make it cheaper (it paces every step)"
    idles = 1.0 - busy[busiest]
    tail = f"; it idles {idles:.0%} of the time (next: {_next_busiest(busy, busiest)})" if 1.0 / max(
        busy[busiest], 1e-9) > BUBBLE_GOAL else ""
    return f"{head}; {advice}{tail}"
