"""The run's timeline and report end to end: verl's command with the flag and `+trainer.async_trace_path`
writes one Chrome-trace file in which every trained batch passes every stage on its path, in order, and
every version's receiver calls appear for every receiver; the report beside it names the bottleneck
(training with four epochs a step, generation with one sequence decoded at a time); a slow rollout
replica shows on its own track; a stalled run's error comes with both."""

from __future__ import annotations

import json
import re

from helpers.browser import open_page
from helpers.processes import assert_nothing_left
from helpers.rows import step_rows
from helpers.runs import run_verl, start_verl

from async_rl.core.fault_points import DELAY_ENV, HOLD_AT_ENV, HOLD_DIR_ENV
from async_rl.core.stage_graph import build_edges
from async_rl.report.charts import CHART_W, LABEL_W

STEPS = 4
PATH = ("dataloader", "generate", "rollout", "reward", "logp", "actor_train")


# the demo's training and generation are close (under load either can be the busier): four epochs a step
# make training the bottleneck whatever the load
TRAINING_BOUND = {"actor_rollout_ref.actor.ppo_epochs": 4}


def test_a_short_runs_timeline(demo_dir, tmp_path, ray_address):
    trace_dir = tmp_path / "trace"
    extra = {"trainer.total_training_steps": STEPS, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "+trainer.async_trace_path": str(trace_dir), **TRAINING_BOUND}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=400, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert sorted(step_rows(rows)) == list(range(1, STEPS + 1))
    document = json.loads((trace_dir / "trace.json").read_text())
    events = document["traceEvents"]
    owners = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
    work = {}
    for span in spans:
        if tracks[(span["pid"], span["tid"])] == "work" and "index" in span["args"]:
            work.setdefault(owners[span["pid"]], []).append(span["args"]["index"])
    for stage in PATH:  # every trained batch (index 0 is step 1's), in order; none twice
        assert work[f"stage {stage}"][:STEPS] == list(range(STEPS)), (stage, work.get(f"stage {stage}"))
    # each work span's version: generate's, the one served as it began (k = 2: batch j starts at j - 1 or j);
    # the stages after it, the batch's; actor_train's, the trainer's (batch j trains at version j)
    versions = {(owners[s["pid"]], s["args"]["index"]): s["args"].get("version") for s in spans
                if tracks[(s["pid"], s["tid"])] == "work" and "index" in s["args"]}
    for index in range(STEPS):
        generated = versions[("stage generate", index)]
        assert generated in (index - 1, index), (index, generated)
        assert versions[("stage reward", index)] == generated and versions[("stage actor_train", index)] == index
    # each batch leaves a stage before a stage downstream of it finishes it
    ends = {(owners[s["pid"]], s["args"]["index"]): s["ts"] + s["dur"] for s in spans
            if tracks[(s["pid"], s["tid"])] == "work" and "index" in s["args"]}
    edges = [(up, down) for up in PATH for down in build_edges()[up] if down in PATH]  # reward and logp: siblings
    assert len(edges) == 6, edges
    for earlier, later in edges:
        for index in range(STEPS):  # one host, one clock (stages elsewhere: aligned within half a round trip)
            assert ends[(f"stage {earlier}", index)] <= ends[(f"stage {later}", index)] + 5e4, (earlier, later, index)
    # every version's recv, register-buffer and load on every receiver (the demo: one rollout server), and the
    # trainer's gather and send: the five parts
    sync = [s for s in spans if owners[s["pid"]] == "stage param_update"]
    receivers = {tracks[(s["pid"], s["tid"])] for s in sync if tracks[(s["pid"], s["tid"])].startswith("receiver ")}
    assert receivers
    for receiver in receivers:
        loaded = sorted(s["args"]["version"] for s in sync
                        if tracks[(s["pid"], s["tid"])] == receiver and s["name"] == "load")
        assert loaded == list(range(1, STEPS + 1)), (receiver, loaded)
        for part in ("recv", "register-buffer"):  # per bucket or per version, inside its receiver call
            staged = {s["args"]["version"] for s in sync if tracks[(s["pid"], s["tid"])] == receiver and s["name"] == part}
            assert staged == set(range(1, STEPS + 1)), (receiver, part, staged)
    assert all(s["args"]["interrupted"] >= 0 for s in sync if s["name"] == "load")  # the CPU server counts them
    for part in ("gather", "send"):
        assert sorted(s["args"]["version"] for s in sync if s["name"] == part) == list(range(1, STEPS + 1)), part
    ranks = [s for s in spans if tracks[(s["pid"], s["tid"])] == "train ranks"]  # the actor_train stage's calls
    for name, key in (("pi_prox", "step"), ("update", "step"), ("gather and send", "version")):
        assert sorted(s["args"][key] for s in ranks if s["name"] == name) == list(range(1, STEPS + 1)), name
    assert "timeline written to" in out
    assert verdict(trace_dir).startswith("training is the slowest stage: actor_train"), verdict(trace_dir)
    page = open_page(trace_dir / "report.html")  # as a person sees it in a browser
    assert page.errors == [] and page.title.startswith("Run report: copy_digits, ") and str(tmp_path) not in page.title
    assert page.verdict and page.verdict[0].startswith("training is the slowest stage: actor_train")
    assert page.charts["Timeline"]["visible"] and page.charts["Busy and waiting"]["visible"]
    busy = page.charts["Busy and waiting"]
    assert all(right <= busy["box"][0] + LABEL_W + CHART_W + 0.5 for _, right in busy["bars"]), busy["bars"]


def verdict(trace_dir) -> str:
    page = (trace_dir / "report.html").read_text()
    return re.search(r'class="verdict">(.*?)</p>', page).group(1)


def test_a_generation_bound_runs_report_names_generation(demo_dir, tmp_path, ray_address):
    trace_dir = tmp_path / "trace"
    extra = {"trainer.total_training_steps": STEPS, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "+trainer.async_trace_path": str(trace_dir), "actor_rollout_ref.rollout.max_num_seqs": 1}
    code, out, _ = run_verl(demo_dir, extra, tmp_path, timeout_s=400, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert verdict(trace_dir).startswith("generation is the slowest stage: generate"), verdict(trace_dir)


def test_a_stalled_runs_error_comes_with_its_timeline_and_report(demo_dir, tmp_path):
    trace_dir, holds = tmp_path / "trace", tmp_path / "holds"
    holds.mkdir()
    extra = {"trainer.total_training_steps": STEPS, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "+trainer.async_trace_path": str(trace_dir), "+trainer.async_stall_timeout_s": 15}
    proc = start_verl(demo_dir, extra, tmp_path, env={HOLD_AT_ENV: "train_step@3", HOLD_DIR_ENV: str(holds)})
    assert proc.wait(timeout=400) != 0
    log = (tmp_path / "metrics.jsonl.log").read_text()
    assert "no training step completed for 15 s" in log and f"the timeline so far: {trace_dir}/trace.json" in log, \
        log[-3000:]
    document = json.loads((trace_dir / "trace.json").read_text())
    owners = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    trained = sorted((e["args"]["index"], e["args"].get("open", False)) for e in document["traceEvents"]
                     if e["ph"] == "X" and owners[e["pid"]] == "stage actor_train"
                     and tracks[(e["pid"], e["tid"])] == "work")
    assert trained == [(0, False), (1, False), (2, True)], trained  # step 3's span still running: the hang
    assert (trace_dir / "report.html").exists()
    assert_nothing_left(proc, "after the stall")


# 2 s: well above the spread that load alone gives a replica's serving spans on 2 cores (about 0.5 s)
SLOW_REPLICA_DELAY_S = 2.0


def test_a_slow_replica_has_the_longest_serving_spans_on_its_own_track(demo_dir, tmp_path):
    trace_dir = tmp_path / "trace"
    extra = {"trainer.total_training_steps": 3, "trainer.test_freq": -1, "trainer.val_before_train": False,
             "+trainer.async_trace_path": str(trace_dir), "trainer.n_gpus_per_node": 4,
             "+trainer.use_nodes_ratios": [0.25, 0.25, 0.25, 0.5]}  # 2 rollout replicas
    proc = start_verl(demo_dir, extra, tmp_path, env={DELAY_ENV: f"rollout_replica@1={SLOW_REPLICA_DELAY_S}"})
    assert proc.wait(timeout=400) == 0, (tmp_path / "metrics.jsonl.log").read_text()[-3000:]
    document = json.loads((trace_dir / "trace.json").read_text())
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in document["traceEvents"] if e["name"] == "thread_name"}
    serving = {}
    for e in document["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "serving":
            serving.setdefault(tracks[(e["pid"], e["tid"])], []).append(e["dur"] / 1e6)
    assert set(serving) == {"replica 0", "replica 1"}, serving.keys()
    # every request of replica 1 starts SLOW_REPLICA_DELAY_S late: each of its serving spans holds the delay
    assert min(serving["replica 1"]) >= SLOW_REPLICA_DELAY_S, serving
    assert max(serving["replica 1"]) > max(serving["replica 0"]) + SLOW_REPLICA_DELAY_S / 2, serving
    assert_nothing_left(proc, "after the slow-replica run")
