"""The run's timeline (async_rl/core/trace.py and the stages' spans in state_machines/base.py): what a
stage records, the clock alignment, and the Chrome-trace file the driver writes."""

from __future__ import annotations

import json

from async_rl.core.trace import TraceRecorder, chrome_events, clock_offset, same_clock, write_trace
from helpers.stage_chain import traced_run


def test_a_disabled_recorder_records_nothing_and_an_enabled_one_pops_each_span_once():
    recorder = TraceRecorder("stage x")
    with recorder.span("work", "process", index=1):
        pass
    recorder.add("work", "process", 1.0, 2.0)
    assert recorder.pop()["events"] == []
    recorder.enable()
    with recorder.span("work", "process", index=1):
        pass
    recorder.add("wait", "wait input", 1.0, 2.5)
    popped = recorder.pop()
    assert popped["owner"] == "stage x" and [e[:2] for e in popped["events"]] == [("work", "process"),
                                                                                  ("wait", "wait input")]
    assert popped["events"][0][4] == {"index": 1} and popped["events"][0][2] <= popped["events"][0][3]
    assert recorder.pop()["events"] == []


def test_past_max_events_the_oldest_go_and_are_counted():
    recorder = TraceRecorder("stage x", enabled=True, max_events=3)
    for i in range(5):
        recorder.add("work", "process", i, i + 1, index=i)
    popped = recorder.pop()
    assert [e[4]["index"] for e in popped["events"]] == [2, 3, 4] and popped["dropped"] == 2


def test_clock_offset_recovers_a_remote_clocks_shift():
    import time

    assert abs(clock_offset(lambda: time.time() - 100.0) - 100.0) < 0.05
    assert abs(clock_offset(lambda: time.time() + 3.0) + 3.0) < 0.05


def test_clock_offset_keeps_the_quickest_round_trip_so_a_held_up_reply_does_not_shift_it():
    import time

    trips = []

    def remote_read_then_reply_held_up_on_the_first_trip():  # a busy process: its answer waits 0.4 s
        now = time.time() - 100.0
        if not trips:
            time.sleep(0.4)
        trips.append(now)
        return now

    assert abs(clock_offset(remote_read_then_reply_held_up_on_the_first_trip) - 100.0) < 0.05
    assert len(trips) == 3


def test_a_batch_popped_on_this_host_shares_its_clock_and_one_from_elsewhere_does_not():
    popped = TraceRecorder("stage x", enabled=True).pop()
    assert same_clock(popped)
    assert not same_clock({**popped, "host": popped["host"] + "-elsewhere"}) and not same_clock({"owner": "x"})


def test_stages_record_every_item_in_order_and_the_waits_on_a_slow_neighbour(tmp_path):
    n = 6
    batches = traced_run(n, delay=0.02)
    by_owner = {b["owner"]: b["events"] for b in batches}
    for owner in ("stage source", "stage mapper", "stage sink"):
        work = [e for e in by_owner[owner] if e[0] == "work"]
        assert [e[4]["index"] for e in work] == list(range(n)), owner  # every item, in order
        assert all("version" not in e[4] for e in work)  # these items carry no start_version
    # the source outruns the slow mapper (inbox of 1): it waits downstream; the sink waits for input
    assert sum(e[3] - e[2] for e in by_owner["stage source"] if e[1] == "wait downstream") > 0.02
    assert sum(e[3] - e[2] for e in by_owner["stage sink"] if e[1] == "wait input") > 0.02

    path = write_trace(str(tmp_path / "t" / "trace.json"), batches, {"stage sink": 10.0})
    document = json.load(open(path))
    spans = [e for e in document["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
    assert names == {"stage source", "stage mapper", "stage sink"}
    assert {e["name"] for e in spans} >= {"process", "wait input", "wait downstream"}
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in spans)
    sink_pid = next(e["pid"] for e in document["traceEvents"] if e.get("args", {}).get("name") == "stage sink")
    first_sink = min(e["ts"] for e in spans if e["pid"] == sink_pid)
    raw_first = min(e[2] for e in by_owner["stage sink"])
    assert abs(first_sink - (raw_first + 10.0) * 1e6) < 1.0  # the sink's offset applied, in microseconds


def test_chrome_events_name_one_thread_per_track():
    events = chrome_events([{"owner": "stage a", "events": [("work", "process", 1.0, 2.0, {}),
                                                           ("wait", "wait input", 2.0, 3.0, {}),
                                                           ("work", "process", 3.0, 4.0, {})]}])
    threads = [e for e in events if e["name"] == "thread_name"]
    assert sorted(t["args"]["name"] for t in threads) == ["wait", "work"]
    spans = [e for e in events if e["ph"] == "X"]
    assert [s["dur"] for s in spans] == [1e6, 1e6, 1e6] and spans[0]["tid"] == spans[2]["tid"] != spans[1]["tid"]


def test_a_pop_shows_the_spans_still_running_as_open():
    recorder = TraceRecorder("stage x", enabled=True)
    with recorder.span("work", "process", index=7):
        running = recorder.pop()["events"]
        assert [(e[1], e[4]) for e in running] == [("process", {"index": 7, "open": True})]
    assert [e[4] for e in recorder.pop()["events"]] == [{"index": 7}]  # closed: recorded as any span


def test_overlapping_spans_of_one_track_go_to_threads_of_the_same_name():
    events = chrome_events([{"owner": "stage generate", "events": [("work", "process", 0.0, 5.0, {"index": 0}),
                                                                  ("work", "process", 4.0, 9.0, {"index": 1}),
                                                                  ("work", "process", 6.0, 7.0, {"index": 2})]}])
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    spans = {e["args"]["index"]: e["tid"] for e in events if e["ph"] == "X"}
    assert set(threads.values()) == {"work"} and len(threads) == 2
    assert spans[0] == spans[2] != spans[1]  # batch 2 starts after batch 0 ended: back on the first thread


def test_a_work_span_carries_the_batch_index_and_the_version_it_was_generated_from():
    from types import SimpleNamespace

    from state_machines.base import StateMachine

    generated = SimpleNamespace(index=3, start_version=2)
    assert StateMachine.trace_args(None, generated) == {"index": 3, "version": 2}
    assert StateMachine.trace_args(None, {"logp": generated, "reward": generated}) == {"index": 3, "version": 2}
    assert StateMachine.trace_args(None, SimpleNamespace(index=3)) == {"index": 3}
