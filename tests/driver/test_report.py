"""The run's report (async_rl/report) and the bottleneck sentence (async_rl/core/bottleneck.py): the numbers
it takes from a timeline and a metrics file, the stage it names, and the page and CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from async_rl.core.bottleneck import bottleneck_sentence, waiting_cause
from async_rl.core.trace import write_trace
from async_rl.report import ReportError, write_report
from async_rl.report.__main__ import main as report_main
from async_rl.report.charts import CHART_W, LABEL_W
from async_rl.report.summary import covered_s, read_metrics, read_timeline
from helpers.stage_chain import traced_run


def test_covered_seconds_count_overlaps_once():
    assert covered_s([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert covered_s([(0, 4), (1, 2)]) == pytest.approx(4.0)
    assert covered_s([]) == 0.0


def test_the_sentence_names_the_slowest_stage_and_the_devices_that_would_help():
    gen_bound = bottleneck_sentence({"generate": 0.96, "actor_train": 0.3, "reward": 0.01}, ahead=2)
    assert gen_bound.startswith("generation is the slowest stage: generate 96% busy at k=2")
    assert "more generate devices (the train devices are 30% busy)" in gen_bound and "use_nodes_ratios" in gen_bound
    train_bound = bottleneck_sentence({"generate": 0.15, "actor_train": 0.99, "param_update": 0.01, "logp": 0.0},
                                      ahead=3)  # logp without work (pi_prox on the train ranks): not a spare device
    assert train_bound.startswith("training is the slowest stage: actor_train 99% busy at k=3")
    assert "more train devices (the generate devices are 15% busy)" in train_bound
    assert "no devices of its own" in bottleneck_sentence({"reward": 0.95, "generate": 0.2}, ahead=2)
    assert "idles" not in train_bound  # 99% busy: it does not wait
    short = bottleneck_sentence({"actor_train": 0.8, "generate": 0.34, "reward": 0.02}, ahead=2)
    assert short.startswith("training is the slowest stage") and "it idles 20% of the time (next: generate 0.34" in short
    # a busiest stage far from saturated waits on the others: the cause, not "the slowest stage"
    waits = bottleneck_sentence({"actor_train": 0.6, "generate": 0.35}, ahead=1)
    assert waits.startswith("the busiest stage waits: generate_ahead_steps=1 is synchronous")
    assert waiting_cause({"actor_train": 0.95, "generate": 0.5}, ahead=2) is None


class Stage:
    """A stand-in for a stage's recorder output: spans given directly (seconds)."""

    def __init__(self, owner):
        self.batch = {"owner": owner, "events": [], "dropped": 0}

    def work(self, index, start, end):
        self.batch["events"].append(("work", "process", start, end, {"index": index}))

    def wait(self, name, start, end):
        self.batch["events"].append(("wait", name, start, end, {}))


def generation_bound_trace(path):
    """10 s: generate busy 9 s (two overlapping batches count once), actor_train 2 s and waiting for input
    the rest; version 1's sync parts on two receivers."""
    gen, train, sync = Stage("stage generate"), Stage("stage actor_train"), Stage("stage param_update")
    gen.work(0, 100.0, 105.0)
    gen.work(1, 104.0, 109.0)
    train.work(0, 105.0, 106.0)
    train.work(1, 109.0, 110.0)
    train.wait("wait input", 106.0, 109.0)
    gen.batch["events"] += [("replica 0", "serving", 100.5, 104.0, {"items": 8}),
                            ("replica 0", "lost", 104.0, 104.0, {"cause": "ActorDiedError"})]
    sync.batch["events"] += [("trainer", "gather", 106.0, 106.2, {"version": 1}),
                             # two bucket calls on server 0, one whole-version call on server 1, each with
                             # its recv and register-buffer at its end (the call's own span is not a part)
                             ("receiver server 0", "recv + register-buffer", 106.1, 106.2, {"version": 1}),
                             ("receiver server 0", "recv", 106.12, 106.15, {"version": 1}),
                             ("receiver server 0", "register-buffer", 106.15, 106.2, {"version": 1}),
                             ("receiver server 0", "recv + register-buffer", 106.15, 106.25, {"version": 1}),
                             ("receiver server 0", "recv", 106.18, 106.2, {"version": 1}),
                             ("receiver server 0", "register-buffer", 106.2, 106.25, {"version": 1}),
                             ("receiver server 1", "recv + register-buffer + check", 106.2, 106.3, {"version": 1}),
                             ("receiver server 1", "recv", 106.2, 106.28, {"version": 1}),
                             ("receiver server 1", "register-buffer", 106.28, 106.29, {"version": 1}),
                             ("receiver server 0", "load", 106.3, 106.4, {"version": 1}),
                             ("receiver server 1", "load", 106.3, 106.6, {"version": 1})]
    return write_trace(str(path), [gen.batch, train.batch, sync.batch], run={"generate_ahead_steps": 2})


def metrics_file(path, steps=4):
    rows = [{"step": s, "data": {"training/global_step": s, "timing_s/step": 2.0, "critic/score/mean": 0.1 * s,
                                 "async/generate/busy_ratio": 0.9, "async/actor_train/busy_ratio": 0.4,
                                 "async/staleness/hist_0": 0.25, "async/staleness/hist_1": 0.75}}
            for s in range(1, steps + 1)]
    rows.append({"step": steps, "data": {"val-core/demo/reward/mean@1": 0.5}})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_the_timeline_gives_each_stages_busy_and_waiting_seconds_and_each_versions_parts(tmp_path):
    timeline = read_timeline(generation_bound_trace(tmp_path / "trace.json"))
    assert timeline.window_s == pytest.approx(10.0)
    assert timeline.stages["generate"].busy_s == pytest.approx(9.0) and timeline.stages["generate"].items == 2
    assert timeline.stages["actor_train"].busy_s == pytest.approx(2.0)
    assert timeline.stages["actor_train"].waits_s == {"wait input": pytest.approx(3.0)}
    # per receiver the union of its calls, then the slowest receiver
    assert timeline.sync == {1: {"gather": pytest.approx(0.2), "recv": pytest.approx(0.08),
                                 "register-buffer": pytest.approx(0.1), "load": pytest.approx(0.3)}}
    assert timeline.run == {"generate_ahead_steps": 2}
    assert [title for *_, title in timeline.work_spans["generate"]] == ["generate: batch 0", "generate: batch 1"]
    assert [(a, b) for a, b, _ in timeline.replica_spans["replica 0"]] == [(0.5, 4.0), (4.0, 4.0)]
    assert "lost" in timeline.replica_spans["replica 0"][1][2]


def test_metrics_rows_merge_by_step_and_average_after_warm_up(tmp_path):
    metrics = read_metrics(metrics_file(tmp_path / "m.jsonl"))
    assert list(metrics.steps) == [1, 2, 3, 4] and metrics.steps[4]["val-core/demo/reward/mean@1"] == 0.5
    assert metrics.mean("critic/score/mean") == pytest.approx(0.3)  # steps 2-4
    assert metrics.staleness_hist() == {0: pytest.approx(0.25), 1: pytest.approx(0.75)}
    assert metrics.busy_ratios() == {"actor_train": pytest.approx(0.4), "generate": pytest.approx(0.9)}


def test_the_page_names_the_bottleneck_and_holds_every_section(tmp_path):
    generation_bound_trace(tmp_path / "trace.json")
    page = open(write_report(str(tmp_path))).read()
    assert "generation is the slowest stage: generate 90% busy at k=2" in page  # from the timeline: 9 of 10 s
    assert "the timeline&#x27;s work spans" in page and "Reward" not in page  # no metrics given
    assert page.count("<svg") == 3  # timeline, busy and waiting, weight sync
    page = open(write_report(str(tmp_path), metrics_file(tmp_path / "m.jsonl"))).read()
    assert "async/&lt;stage&gt;/busy_ratio in the metrics" in page
    for title in ("Timeline", "Reward", "Step time by stage", "Busy and waiting", "Staleness",
                  "Weight sync per version", "Planner"):
        assert f"<h2>{title}</h2>" in page, title
    assert "No plan:" in page  # these metrics hold no placement (async/devices/*): the planner says so
    assert "<script" not in page


def test_a_slow_middle_stage_is_named_from_a_real_stage_chains_timeline(tmp_path):
    write_trace(str(tmp_path / "trace.json"), traced_run(8, delay=0.05))
    busy = read_timeline(str(tmp_path / "trace.json")).busy_ratios()
    assert max(busy, key=busy.get) == "mapper" and busy["mapper"] > 0.8 > busy["sink"]
    assert "mapper is the slowest stage" in open(write_report(str(tmp_path))).read()


def test_the_cli_writes_the_page_and_names_a_missing_timeline(tmp_path, capsys):
    generation_bound_trace(tmp_path / "trace.json")
    assert report_main([str(tmp_path)]) == 0
    assert "report written to" in capsys.readouterr().out and (tmp_path / "report.html").exists()
    assert report_main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere/trace.json is not a timeline" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(ReportError, match="bad.jsonl line 1"):
        write_report(str(tmp_path), str(tmp_path / "bad.jsonl"))


def test_a_restart_keeps_the_failed_attempts_timeline_and_report(tmp_path):
    from async_rl.run_trace import keep_earlier_attempt

    generation_bound_trace(tmp_path / "trace.json")
    write_report(str(tmp_path))
    keep_earlier_attempt(str(tmp_path), attempt=0)  # the first run: nothing earlier to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html", "trace.json"]
    keep_earlier_attempt(str(tmp_path), attempt=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report_attempt0.html", "trace_attempt0.json"]
    keep_earlier_attempt(str(tmp_path), attempt=2)  # attempt 1 wrote nothing: attempt 0's files stay
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report_attempt0.html", "trace_attempt0.json"]


def many_versions_trace(path, versions=300):
    """A stage waiting for input on three batches at once while busy with none, another busy all along, and
    `versions` weight syncs whose load grows with the version (the last ones slowest)."""
    gen, train, sync = Stage("stage generate"), Stage("stage actor_train"), Stage("stage param_update")
    gen.work(0, 1000.0, 1010.0)
    train.work(0, 1000.0, 1002.0)
    for _ in range(3):  # three items waiting at once: one second of waiting, not three
        train.wait("wait input", 1002.0, 1009.0)
    train.wait("wait downstream", 1001.0, 1003.0)  # 1 s of it while busy, 1 s while also waiting for input
    for v in range(1, versions + 1):
        sync.batch["events"] += [("trainer", "gather", 1000.0, 1000.01, {"version": v}),
                                 ("receiver server 0", "load", 1000.0, 1000.0 + v / 1000, {"version": v})]
    return write_trace(str(path), [gen.batch, train.batch, sync.batch],
                       run={"generate_ahead_steps": 2, "experiment_name": "copy_digits"})


def test_each_second_of_a_stage_counts_once_and_the_sync_is_a_distribution(tmp_path):
    timeline = read_timeline(many_versions_trace(tmp_path / "trace.json"))
    train = timeline.stages["actor_train"]
    assert train.waits_s["wait input"] == pytest.approx(7.0)  # three at once count once
    assert train.shares_s == {"busy": pytest.approx(2.0), "wait input": pytest.approx(7.0),
                              "wait downstream": pytest.approx(0.0), "admission (staleness bound)": 0.0,
                              "idle": pytest.approx(1.0)}
    assert sum(train.shares_s.values()) == pytest.approx(timeline.window_s)
    page = open(write_report(str(tmp_path))).read()
    assert "<title>Run report: copy_digits, 1970-01-01 00:16 UTC</title>" in page  # experiment and the window's start
    assert str(tmp_path) not in page
    # the whole sync's median, p90 and max over 300 versions (gather 0.01 s + load v / 1000 s)
    assert "<td>whole sync</td><td>0.16</td><td>0.28</td><td>0.31</td>" in page
    assert re.findall(r">version (\d+)</text>", page) == ["296", "297", "298", "299", "300"]  # the 5 slowest


def test_the_page_renders_in_a_browser_with_its_bars_inside_their_axes(tmp_path):
    from helpers.browser import open_page

    many_versions_trace(tmp_path / "trace.json")
    page = open_page(Path(write_report(str(tmp_path), metrics_file(tmp_path / "m.jsonl"))))
    assert page.errors == []
    assert page.title == "Run report: copy_digits, 1970-01-01 00:16 UTC"
    assert page.verdict and page.verdict[0].startswith("generation is the slowest stage")
    assert page.charts["Timeline"]["visible"] and page.charts["Busy and waiting"]["visible"]
    busy = page.charts["Busy and waiting"]
    axis_right = busy["box"][0] + LABEL_W + CHART_W
    assert all(right <= axis_right + 0.5 for _, right in busy["bars"]), (axis_right, busy["bars"])
    totals = [float(t.split()[0]) for t in busy["texts"] if t.endswith(" %")]
    assert totals and max(totals) <= 100.0
