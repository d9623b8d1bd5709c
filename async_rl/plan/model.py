"""The planner's model of a step (the rules: async_rl/plan/__init__.py) and the ranking of layouts."""

from __future__ import annotations

import heapq
import json
import math
from bisect import bisect_left
from dataclasses import dataclass, field

from async_rl.core.bottleneck import STAGE_ROLE
from async_rl.core.placement import TRAINING_ROLES, DeviceRange, Placement, PlacementError, plan_placement

RATIO_ROLES = ("train", "logp", "ref_logp", "generate")  # the order of use_nodes_ratios; the critic 5th
SERIAL = ("rollout", "param_update")  # fixed stages in series on a batch's way; verl's sync step has neither


class PlanError(ValueError):
    """The metrics or the cluster give nothing to plan from."""


@dataclass
class Workload:
    """Per step: work (role -> device-s), fixed (stage -> s), gather_s, tail_s (s), ahead (k), efficiency
    (training throughput kept per doubling of devices above ref_devices; >= 0.5: more devices, less time)."""

    work: dict[str, float]
    fixed: dict[str, float] = field(default_factory=dict)
    gather_s: float = 0.0
    tail_s: float = 0.0
    ahead: int = 2
    efficiency: float = 1.0
    ref_devices: int = 1

    @property
    def roles(self) -> list[str]:  # the training roles with workers, in placement order
        return [r for r in TRAINING_ROLES if r in self.work]

    def time(self, role: str, n: int) -> float:
        """Seconds of `role`'s devices per step on `n` devices (generate: at its decoding throughput)."""
        if role == "generate":
            return self.work[role] / n
        scale = self.efficiency ** max(0.0, math.log2(n / self.ref_devices))
        return self.work[role] / (n * scale) + (self.gather_s if role == "train" else 0.0)


def read_run(path: str, warmup: int = 2, cooldown: int = 1) -> tuple[Workload, dict]:
    """(Workload, the run's own numbers) from a verl `file` backend JSONL, skipping validation rows, the
    first `warmup` steps and the last `cooldown` (generation ends generate_ahead_steps - 1 steps before
    training does); PlanError naming what is missing."""
    try:
        lines, steps = open(path).read().splitlines(), {}
    except OSError as exc:
        raise PlanError(f"cannot read metrics file {path}: {exc}") from exc
    for number, line in enumerate(lines, 1):
        try:
            data = json.loads(line).get("data", {}) if line.strip() else {}
        except (json.JSONDecodeError, AttributeError) as exc:
            raise PlanError(f"{path} line {number} is not a JSON row of verl's file logger: {exc}") from exc
        if "training/global_step" in data and "timing_s/step" in data:
            steps[int(data["training/global_step"])] = data
    if len(steps) <= warmup + cooldown:
        raise PlanError(f"{path} has {len(steps)} training step(s) (rows with training/global_step and "
                        f"timing_s/step); the planner skips the first {warmup} and the last {cooldown}: run more")
    later = [steps[s] for s in sorted(steps)[warmup:len(steps) - cooldown]]
    if any("async/devices/generate" not in d or "async/devices/train" not in d for d in later):
        raise PlanError(f"{path} lacks async/devices/* (the run's placement, logged every step): a run from "
                        "before they were logged, or not of the async pipeline; rerun it with this version")
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    stages = {k.split("/")[1] for d in later for k in d if k.startswith("async/") and k.endswith("/busy_ratio")}
    busy = {s: mean([d.get(f"async/{s}/busy_ratio", 0.0) * d["timing_s/step"] for d in later]) for s in sorted(stages)}
    if "actor_train" not in busy or "generate" not in busy:
        raise PlanError(f"{path} lacks async/actor_train/busy_ratio or async/generate/busy_ratio")
    devices = {k[len("async/devices/"):]: int(v) for k, v in later[-1].items() if k.startswith("async/devices/")}
    shared = bool(devices.pop("shared", 0))
    wl = Workload(work={}, gather_s=mean([d.get("timing_s/gather_weights", 0.0) for d in later]))
    for stage, seconds in busy.items():
        role = STAGE_ROLE.get(stage)
        if role in devices:  # logp holds no devices when pi_prox is computed on the train ranks
            own = max(0.0, seconds - wl.gather_s) if role == "train" else seconds
            wl.work[role] = wl.work.get(role, 0.0) + own * devices[role]
        else:
            wl.fixed[stage] = seconds
    return wl, {"steps": len(later), "step_s": mean([d["timing_s/step"] for d in later]), "devices": devices,
                "shared": shared, "busy_s": busy}


def _step(wl: Workload, gen: int, load: float, middle: float, end: float) -> float:
    """Async step (s): `load` the busiest device's s, `middle` / `end` the log-prob passes' / updates' s
    on their busiest device (the dataloader prefetches: on no batch's way)."""
    side = max([middle] + [s for stage, s in wl.fixed.items() if stage not in (*SERIAL, "dataloader")])
    way = max(wl.time("generate", gen), wl.tail_s) + side + end + sum(wl.fixed.get(s, 0.0) for s in SERIAL)
    return max(load, max(wl.fixed.values(), default=0.0), way / wl.ahead)


def predict(placement: Placement, wl: Workload) -> tuple[float, float]:
    """(async step s, bubble) of `wl` on `placement`."""
    total = placement.nodes * placement.devices_per_node
    gen = DeviceRange(placement.replicas[0].start, total - placement.replicas[0].start)  # consecutive, at the end
    ranges = {**placement.groups, "generate": gen}
    cuts = sorted({0, total, *(r.start for r in ranges.values()), *(r.stop for r in ranges.values())})
    busy, most, middle, end = 0.0, 0.0, 0.0, 0.0
    for a, b in zip(cuts, cuts[1:]):
        times = {role: wl.time(role, r.count) for role, r in ranges.items() if r.start <= a and b <= r.stop}
        busy, most = busy + sum(times.values()) * (b - a), max(most, sum(times.values()))
        middle = max(middle, sum(t for role, t in times.items() if role in ("logp", "ref_logp")))
        end = max(end, sum(t for role, t in times.items() if role in ("train", "critic")))
    step = _step(wl, gen.count, most, middle, end)
    return step, (1.0 - busy / (total * step) if step > 0 else 0.0)


def sync_step(wl: Workload, total: int) -> float:
    """Seconds per step of verl's synchronous schedule on all `total` devices."""
    return (max(wl.time("generate", total), wl.tail_s) + sum(wl.time(r, total) for r in wl.roles)
            + sum(s for stage, s in wl.fixed.items() if stage not in SERIAL))


def ratio_of(size: int, total: int) -> float:
    """A short ratio r in (0, 1] with floor(r x total) == size."""
    return next((r for d in range(2, 8) if 0 < (r := round(size / total, d)) <= 1 and math.floor(r * total) == size),
                (size + 0.5) / total)


def _bound(wl: Workload, gen: int, per_node: int, total: int) -> float:
    """No split with `gen` generate devices steps faster (s): each role on the largest group it could get."""
    left = total - gen
    t = {r: wl.time(r, left if left <= per_node else left // per_node * per_node) for r in wl.roles}
    return _step(wl, gen, max([wl.time("generate", gen), *t.values()]),
                 max(t.get("logp", 0.0), t.get("ref_logp", 0.0)), max(t.get("train", 0.0), t.get("critic", 0.0)))


def candidates(nodes: int, per_node: int, wl: Workload, replica_devices: int = 1, keep: int | None = None
               ) -> list[dict]:
    """Each generate share in whole replicas; for each, the training roles all on the training devices
    (shared) and side by side (per target time, each role's fewest devices meeting it); those
    `plan_placement` accepts, by predicted step (s), then bubble: dicts of override, ratios, devices (role
    -> count), shared, step_s, bubble. `keep`: skip the generate shares that cannot beat the keep-th best."""
    total, roles, seen, out, error, best = nodes * per_node, wl.roles, set(), [], None, []
    for gen in sorted(range(replica_devices, total, replica_devices), key=lambda g: _bound(wl, g, per_node, total)):
        if keep and len(best) >= keep and _bound(wl, gen, per_node, total) > -best[0] + 1e-9:
            break
        left = total - gen
        sizes = sorted({*range(1, min(per_node, left) + 1), *range(per_node, left + 1, per_node)})
        splits = [dict.fromkeys(roles, sizes[-1])]
        times = {r: [-wl.time(r, s) for s in sizes] for r in roles}  # ascending: more devices, less time
        for target in sorted({-t for ts in times.values() for t in ts}, reverse=True):
            index = {r: bisect_left(times[r], -target - 1e-12) for r in roles}
            split = {r: sizes[i] for r, i in index.items() if i < len(sizes)}
            if len(split) < len(roles) or sum(split.values()) > left:
                break
            splits.append(split)
        for split in splits:
            ratios = [ratio_of(split.get(r, split[roles[0]]), total) for r in RATIO_ROLES[:3]] + [ratio_of(gen, total)]
            ratios += [ratio_of(split["critic"], total)] if "critic" in roles else []
            try:
                placement = plan_placement(nodes, per_node, {**dict(zip(RATIO_ROLES, ratios)), "critic": ratios[-1]},
                                           roles, replica_devices)
            except PlacementError as exc:
                error = exc
                continue
            key = (tuple((r, g.start, g.count) for r, g in placement.groups.items()), len(placement.replicas))
            if key not in seen:
                seen.add(key)
                step, bubble = predict(placement, wl)
                devices = {**{r: g.count for r, g in placement.groups.items()}, "generate": gen}
                out.append({"override": "+trainer.use_nodes_ratios=[" + ",".join(map(repr, ratios)) + "]", "ratios":
                            ratios, "devices": devices, "shared": placement.shared, "step_s": step, "bubble": bubble})
                heapq.heappush(best, -step)
                if keep and len(best) > keep:
                    heapq.heappop(best)
    if not out:
        raise PlanError(f"no trainer.use_nodes_ratios places {roles} and generate (replicas of {replica_devices} "
                        f"device(s)) on {nodes} node(s) x {per_node} devices: " + (str(error) if error else
                        f"generate needs {replica_devices} and training at least 1 of the {total} devices"))
    return sorted(out, key=lambda c: (round(c["step_s"], 9), c["bubble"]))


def devices_used(run: dict, roles) -> int:
    """The devices a measured run (`read_run`'s second value) used: generate's plus its training roles'
    (the largest of them where they shared devices)."""
    devices = run["devices"]
    return devices["generate"] + (max if run["shared"] else sum)(devices[r] for r in roles)


def devices_text(row: dict) -> str:
    return " ".join(f"{r}={n}" for r, n in row["devices"].items()) + (" shared" if row["shared"] else "")
