"""async_rl/plan/: reading a run's metrics, the step model, the ranking, the CLI, and the simulation's claim."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from async_rl.core.placement import plan_placement
from async_rl.plan import PlanError, Workload, candidates, predict, read_run, sync_step
from bench import plan_sim

# a run of the demo on 2 nodes x 2 devices: train and ref_logp sharing 2 devices, generate on 2
DEVICES = {"async/devices/train": 2.0, "async/devices/ref_logp": 2.0, "async/devices/generate": 2.0,
           "async/devices/shared": 1.0}
BUSY = {"actor_train": 0.5, "generate": 0.75, "ref_logp": 0.25, "logp": 0.1, "reward": 0.05, "rollout": 0.02,
        "param_update": 0.04, "dataloader": 0.01}


def step_row(step: int, step_s: float, busy: dict, devices=DEVICES, gather_s: float = 0.1) -> dict:
    data = {"training/global_step": step, "timing_s/step": step_s, "timing_s/gather_weights": gather_s, **devices,
            **{f"async/{s}/busy_ratio": b for s, b in busy.items()}, "critic/score/mean": 0.5}
    return {"step": step, "data": data}


def write_run(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def demo_run(path, devices=DEVICES) -> str:
    """Warm-up steps 1-2 with wild numbers, steps 3-5 at 2 s each, a validation row, and a last step with no
    generation left (it ended generate_ahead_steps - 1 steps before training)."""
    rows = [step_row(1, 30.0, dict.fromkeys(BUSY, 1.0), devices), step_row(2, 9.0, dict.fromkeys(BUSY, 0.9), devices)]
    rows += [step_row(s, 2.0, BUSY, devices) for s in (3, 4, 5)] + [step_row(6, 1.0, {**BUSY, "generate": 0.0})]
    rows.insert(3, {"step": 3, "data": {"val-core/async_rl/copy_digits/reward/mean@1": 0.4}})
    return write_run(path, rows)


def test_read_run_turns_busy_ratios_into_device_seconds(tmp_path):
    wl, run = read_run(demo_run(tmp_path / "m.jsonl"))
    assert run["steps"] == 3 and run["step_s"] == pytest.approx(2.0) and run["shared"] is True
    assert run["devices"] == {"train": 2, "ref_logp": 2, "generate": 2}
    # busy s per step = ratio x 2 s; on devices: x devices (train without the 0.1 s gather it waits)
    assert wl.work == pytest.approx({"train": (1.0 - 0.1) * 2, "generate": 1.5 * 2, "ref_logp": 0.5 * 2})
    assert wl.gather_s == pytest.approx(0.1)
    # logp holds no devices here (pi_prox on the train ranks): a fixed stage like reward
    assert wl.fixed == pytest.approx({"logp": 0.2, "reward": 0.1, "rollout": 0.04, "param_update": 0.08,
                                      "dataloader": 0.02})


def test_busy_seconds_weigh_each_step_by_its_own_time(tmp_path):
    rows = [step_row(1, 5.0, BUSY), step_row(2, 1.0, {**BUSY, "generate": 1.0}),
            step_row(3, 3.0, {**BUSY, "generate": 0.5})]
    wl, run = read_run(write_run(tmp_path / "m.jsonl", rows), warmup=1, cooldown=0)
    assert run["step_s"] == pytest.approx(2.0)
    assert wl.work["generate"] == pytest.approx((1.0 * 1.0 + 0.5 * 3.0) / 2 * 2)  # mean busy s x 2 devices


def test_shared_and_separate_training_roles_by_hand():
    wl = Workload(work={"train": 4.0, "ref_logp": 2.0, "generate": 6.0}, gather_s=0.5)
    ratios = lambda t, r, g: {"train": t, "logp": t, "ref_logp": r, "generate": g}  # noqa: E731
    shared = plan_placement(1, 4, ratios(0.5, 0.5, 0.5), ["train", "ref_logp"], 1)
    assert shared.shared
    # devices 0-1 take turns: train 4/2 + gather 0.5, ref_logp 2/2 = 3.5 s; generate 6/2 = 3 s on devices 2-3
    step, bubble = predict(shared, wl)
    assert step == pytest.approx(3.5) and bubble == pytest.approx(1 - (2 * 3.5 + 2 * 3.0) / (4 * 3.5))
    separate = plan_placement(1, 4, ratios(0.25, 0.25, 0.5), ["train", "ref_logp"], 1)
    assert not separate.shared
    # throughput: train 4 + 0.5 on one device; latency: generate 3 + ref_logp 2 + train 4.5 over k = 2 steps
    step, bubble = predict(separate, wl)
    assert step == pytest.approx((3.0 + 2.0 + 4.5) / 2) and bubble == pytest.approx(1 - (4.5 + 2 + 2 * 3) / (4 * 4.75))
    wl.ahead = 4  # more steps ahead: the latency bound falls under the train device's 4.5 s
    assert predict(separate, wl)[0] == pytest.approx(4.5)
    # verl's schedule: generate 6/4, train 4/4 + gather, ref_logp 2/4, one after another
    assert sync_step(wl, 4) == pytest.approx(1.5 + 1.5 + 0.5)


def test_tail_bounds_sync_by_itself_and_async_over_k_steps():
    wl = Workload(work={"train": 4.0, "generate": 4.0}, tail_s=10.0, ahead=2)
    placement = plan_placement(1, 4, {"train": 0.5, "logp": 0.5, "ref_logp": 0.5, "generate": 0.5}, ["train"], 1)
    assert predict(placement, wl)[0] == pytest.approx((10.0 + 2.0) / 2)
    assert sync_step(wl, 4) == pytest.approx(10.0 + 1.0)


def test_candidates_ranked_by_step_each_placeable_as_printed():
    wl = Workload(work={"train": 4.0, "ref_logp": 2.0, "generate": 6.0}, gather_s=0.5)
    ranked = candidates(1, 4, wl)
    layouts = [(c["devices"]["train"], c["devices"]["ref_logp"], c["devices"]["generate"], c["shared"]) for c in ranked]
    assert layouts[:2] == [(2, 2, 2, True), (1, 1, 2, False)]
    assert ranked[0]["override"] == "+trainer.use_nodes_ratios=[0.5,0.5,0.5,0.5]"
    steps = [c["step_s"] for c in ranked]
    assert steps == sorted(steps) and steps[:2] == pytest.approx([3.5, 4.75])


@pytest.mark.parametrize("nodes,per_node,replica,work", [
    (3, 8, 2, {"train": 30.0, "logp": 10.0, "ref_logp": 8.0, "generate": 90.0}),
    (2, 4, 1, {"train": 30.0, "critic": 20.0, "ref_logp": 8.0, "generate": 40.0}),
    (16, 8, 4, {"train": 900.0, "ref_logp": 300.0, "generate": 2000.0}),
])
def test_every_printed_override_gives_its_devices(nodes, per_node, replica, work):
    wl = Workload(work=work, gather_s=1.0)
    ranked = candidates(nodes, per_node, wl, replica)
    assert ranked
    for c in ranked:
        ratios = json.loads(c["override"].split("=", 1)[1])
        by_role = {**dict(zip(("train", "logp", "ref_logp", "generate"), ratios)), "critic": ratios[-1]}
        placement = plan_placement(nodes, per_node, by_role, wl.roles, replica)
        assert {r: g.count for r, g in placement.groups.items()} == {r: n for r, n in c["devices"].items()
                                                                     if r != "generate"}
        assert sum(r.count for r in placement.replicas) == c["devices"]["generate"]
        assert len(ratios) == (5 if "critic" in work else 4) and all(0 < r <= 1 for r in ratios)


def test_pruned_search_keeps_the_best():
    wl = plan_sim.WORKLOAD
    full = candidates(8, 8, wl)
    for keep in (1, 5):
        assert [c["step_s"] for c in candidates(8, 8, wl, keep=keep)[:keep]] == pytest.approx(
            [c["step_s"] for c in full[:keep]])


def plan_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "async_rl.plan", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_cli_prints_the_table_best_first_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    proc = plan_cli("--metrics", demo_run(tmp_path / "m.jsonl"), "--nodes", "2", "--gpus-per-node", "4",
                    "--top", "3", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("run: 3 steps measured on train=2 ref_logp=2 generate=2 shared: "
                               "2.000 s/step measured")
    assert lines[1].startswith("cluster: 2 node(s) x 4 devices; synchronous schedule")
    assert lines[2].split() == ["#", "step_s", "bubble", "sync_s", "speedup", "devices", "override"]
    table = lines[3:6]
    assert [int(row.split()[0]) for row in table] == [1, 2, 3]
    steps = [float(row.split()[1]) for row in table]
    assert steps == sorted(steps)
    plan = json.loads(out.read_text())
    assert len(plan["candidates"]) == 3 and plan["candidates"][0]["override"] in table[0]
    assert lines[6] == f"best: {plan['candidates'][0]['override']}"
    assert plan["run"]["step_s"] == pytest.approx(2.0) and plan["predicted_run_step_s"] > 0


@pytest.mark.parametrize("content,message", [
    ("", "has 0 training step(s)"),
    ("".join(json.dumps(step_row(s, 1.0, BUSY)) + "\n" for s in (1, 2, 3)), "skips the first 2 and the last 1"),
    ("{\"step\": 1, \"data\": {\"val-core/x\": 1.0}}\n", "has 0 training step(s)"),
    ("not json\n", "line 1 is not a JSON row"),
])
def test_cli_fails_naming_the_cause(tmp_path, content, message):
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    proc = plan_cli("--metrics", str(path), "--nodes", "1", "--gpus-per-node", "4")
    assert proc.returncode == 2 and message in proc.stderr and not proc.stdout


def test_cli_fails_on_a_run_from_before_the_devices_were_logged(tmp_path):
    proc = plan_cli("--metrics", demo_run(tmp_path / "m.jsonl", devices={}), "--nodes", "1", "--gpus-per-node", "4")
    assert proc.returncode == 2 and "lacks async/devices/*" in proc.stderr


def test_cli_fails_when_no_placement_fits(tmp_path):
    proc = plan_cli("--metrics", demo_run(tmp_path / "m.jsonl"), "--nodes", "1", "--gpus-per-node", "1")
    assert proc.returncode == 2 and "no trainer.use_nodes_ratios places ['train', 'ref_logp']" in proc.stderr
    proc = plan_cli("--metrics", demo_run(tmp_path / "m.jsonl"), "--nodes", "1", "--gpus-per-node", "4",
                    "--replica-devices", "3")
    assert proc.returncode == 2 and "must divide the 4 devices of a node" in proc.stderr
    with pytest.raises(PlanError, match="cannot read"):
        read_run(str(tmp_path / "missing.jsonl"))


def test_simulated_speedup_grows_with_the_cluster_until_the_tail_bounds_both():
    sim = plan_sim
    rows = sim.simulate()
    assert [r["gpus"] for r in rows] == [8, 16, 32, 64, 128, 256, 512]
    speedups = [r["speedup"] for r in rows]
    assert speedups == sorted(speedups) and speedups[0] < 1.0 < speedups[-1]
    wl = sim.WORKLOAD
    for r in rows:  # the sync step never beats the tail; the async one never beats the tail over k steps
        assert r["sync_step_s"] >= wl.tail_s and r["async_step_s"] >= wl.tail_s / wl.ahead
    # far beyond, both are bound by the tail and the speed-up settles at the ratio of those bounds, under k
    limit = (wl.tail_s + sum(s for k, s in wl.fixed.items() if k not in ("rollout", "param_update")) + wl.gather_s) / (
        (wl.tail_s + wl.fixed["reward"] + wl.gather_s + wl.fixed["rollout"] + wl.fixed["param_update"]) / wl.ahead)
    assert limit < wl.ahead and speedups[-1] == pytest.approx(limit, rel=0.05)
