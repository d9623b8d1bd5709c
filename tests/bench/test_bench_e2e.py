"""bench/e2e.py: the numbers the side-by-side table reports, from metric rows; a run past its bound is kept."""

import os

import pytest

from bench import e2e


def rows_for(step_s, val_key, vals, **busy):
    """Metric rows as verl's file logger writes them: one per step, validation on some steps."""
    rows = [{"step": 0, "data": {val_key: vals[0]}}]
    for step in range(1, 5):
        data = {"timing_s/step": step_s, "response_length/mean": 10.0, "response_length/max": 20.0, **busy}
        if step in vals:
            data[val_key] = vals[step]
        rows.append({"step": step, "data": data})
    return rows


def test_pipeline_summary_bubble_and_chain():
    busy = {"async/actor_train/busy_ratio": 0.5, "async/logp/busy_ratio": 0.4, "async/generate/busy_ratio": 0.2}
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 2: 0.3, 4: 0.5}, **busy)
    row, curve = e2e.summarize("async-pipeline k=2", 2, rows, samples_per_step=8, target=0.4)
    assert row["wall_s_per_sample"] == pytest.approx(8.0 / 32)  # 4 steps x 2 s over 4 x 8 samples
    assert curve == [(0, 0.0), (4.0, 0.3), (8.0, 0.5)]
    assert row["time_to_target_s"] == 8.0 and row["final_val_reward"] == 0.5
    assert row["busiest_stage"] == "actor_train" and row["bubble_ratio"] == pytest.approx(2.0)
    assert row["train_chain_busy"] == pytest.approx(0.9)


def test_verl_summary_reads_val_aux_and_step_parts():
    parts = {"timing_s/gen": 1.5, "timing_s/update_actor": 0.3}
    rows = rows_for(2.0, e2e.VAL_KEYS[1], {0: 0.0, 4: 0.2}, **parts)
    row, _ = e2e.summarize("verl-sync", None, rows, samples_per_step=8, target=0.4)
    assert row["final_val_reward"] == 0.2 and row["time_to_target_s"] is None
    assert row["busiest_stage"] == "gen" and row["bubble_ratio"] == pytest.approx(2.0 / 1.5)
    assert row["train_chain_busy"] is None


def summarized(k, **busy):
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.5}, **{f"async/{s}/busy_ratio": b for s, b in busy.items()})
    return e2e.summarize(f"async-pipeline k={k}", k, rows, samples_per_step=8, target=0.4)[0]


def test_bottleneck_names_the_cause_only_above_the_goal():
    assert e2e.bottleneck(summarized(2, actor_train=0.95, generate=0.5)) is None  # bubble 1.05
    chain = e2e.bottleneck(summarized(2, actor_train=0.6, logp=0.35, generate=0.2))
    assert "actor_train and logp take turns" in chain and "proximal_logp_workers=train" in chain
    assert "synchronous" in e2e.bottleneck(summarized(1, actor_train=0.6, generate=0.35))
    waits = e2e.bottleneck(summarized(2, actor_train=0.7, generate=0.6, reward=0.1))
    assert waits.startswith("bottleneck: actor_train (busy 0.70)") and "generate 0.60" in waits


def test_ppo_summaries_count_the_critics_parts_and_stages():
    verl_parts = {"timing_s/gen": 0.5, "timing_s/values": 0.2, "timing_s/update_critic": 0.9, "timing_s/update_actor": 0.3}
    row, _ = e2e.summarize("verl-sync PPO", None, rows_for(2.0, e2e.VAL_KEYS[1], {0: 0.0}, **verl_parts), 8, 0.4)
    assert row["busiest_stage"] == "update_critic" and row["busy_ratio"]["values"] == pytest.approx(0.1)
    pipeline = summarized(2, actor_train=0.5, critic_train=0.8, values=0.3)
    assert pipeline["busiest_stage"] == "critic_train" and pipeline["bubble_ratio"] == pytest.approx(1 / 0.8)


def test_step_breakdown_verl_is_its_parts_plus_fixed_overhead():
    parts = {"timing_s/gen": 1.0, "timing_s/old_log_prob": 0.2, "timing_s/values": 0.1, "timing_s/update_actor": 0.3,
             "timing_s/update_critic": 0.1, "timing_s/update_weights": 0.05}
    row, _ = e2e.summarize("verl-sync", None, rows_for(2.0, e2e.VAL_KEYS[1], {0: 0.0}, **parts), 8, e2e.TARGET)
    path, beside = row["breakdown"], row["beside"]
    assert path["generation"] == 1.0 and path["log-prob passes"] == pytest.approx(0.3)
    assert path["update"] == pytest.approx(0.4) and path["weight sync"] == pytest.approx(0.05)
    assert path["waiting"] == 0.0
    assert path["fixed overhead"] == pytest.approx(2.0 - 1.75) and beside == {}


def test_step_breakdown_pipeline_is_the_train_ranks_step_with_the_rest_beside_it():
    metrics = {"timing_s/update_actor": 0.6, "timing_s/old_log_prob": 0.3, "timing_s/gather_weights": 0.1,
               "async/actor_train/busy_ratio": 0.6, "async/generate/busy_ratio": 0.4}
    row, _ = e2e.summarize("async-pipeline k=2", 2, rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0}, **metrics), 8, e2e.TARGET)
    path = row["breakdown"]
    assert path["waiting"] == pytest.approx(2.0 - 1.2)  # the train ranks busy 0.6 of a 2 s step
    assert path["update"] == pytest.approx(0.6) and path["log-prob passes"] == pytest.approx(0.3)
    assert path["weight sync"] == pytest.approx(0.1)
    assert path["fixed overhead"] == pytest.approx(1.2 - 1.0) and path["generation"] == 0.0
    assert row["beside"] == {"generate": pytest.approx(0.8)}


def test_explain_and_the_goal_name_the_parts_and_what_bounds_the_pipeline():
    verl, _ = e2e.summarize("verl-sync", None, rows_for(8.0, e2e.VAL_KEYS[1], {0: 0.0, 4: 0.95},
                                                        **{"timing_s/gen": 5.0, "timing_s/update_actor": 1.0}), 8, 0.9)
    pipe, _ = e2e.summarize("async-pipeline k=2", 2, rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95}, **{
        "timing_s/update_actor": 0.5, "async/actor_train/busy_ratio": 0.5, "async/generate/busy_ratio": 0.25}), 8, 0.9)
    verl["seed"] = pipe["seed"] = 0
    verl["trainer"], pipe["trainer"] = e2e.VERL_SYNC, e2e.PIPELINE
    line = e2e.explain(pipe, verl)
    assert line.startswith("async-pipeline k=2 seed 0: 4.00x per sample")
    assert "generation 5.00 + update 1.00 + fixed overhead 2.00" in line and "beside it: generate 0.50" in line
    assert line.endswith("Generation: 5.00 s of verl's step, 0.50 s busy in the pipeline's generate stage, "
                         "for 10.0 and 10.0 tokens a response")  # measured numbers only, no cause asserted
    why = e2e.why_short_of_goal(pipe, verl)  # the train ranks idle half of each 2 s step: waiting is the bound
    assert why.startswith("its step (2.00 s) is bounded by the train ranks' waiting (1.00 s)")
    assert "bottleneck: actor_train (busy 0.50) waits on its upstream stages: generate 0.25" in why


def test_the_goal_verdict_checks_every_condition_it_prints():
    fast_flat = {"generate_ahead_steps": 2, "bubble_ratio": 1.01}
    assert e2e.goal_verdict(fast_flat, 4.0) == (True, "4.00x >= 3x, bubble 1.01 <= 1.15")
    assert e2e.goal_verdict({**fast_flat, "bubble_ratio": 1.3}, 4.0) == (False, "4.00x >= 3x, bubble 1.30 > 1.15")
    assert e2e.goal_verdict(fast_flat, 2.0)[0] is False and e2e.goal_verdict(fast_flat, None)[0] is False
    # k = 1 waits for each batch by design: only the speed-up is checked, and only it is printed
    assert e2e.goal_verdict({"generate_ahead_steps": 1, "bubble_ratio": 1.7}, 4.0) == (True, "4.00x >= 3x")


def test_a_summary_writes_only_the_files_asked_for(tmp_path, monkeypatch):
    """--json elsewhere and no --png: nothing is drawn (bench/results/ included); the JSON names the command."""
    import json

    runs = tmp_path / "runs"
    runs.mkdir()
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95}, **{"async/actor_train/busy_ratio": 1.0})
    (runs / "async-pipeline_k2_seed0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    written = []
    monkeypatch.setattr(e2e, "plot", lambda *args, **kwargs: written.append(args))
    e2e.main(["--summarize-only", "--metrics-dir", str(runs), "--ks", "2", "--skip-verl", "--seeds", "0",
              "--json", str(tmp_path / "out.json")])
    assert written == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "runs"]
    saved = json.loads((tmp_path / "out.json").read_text())
    assert "# at commit" in saved["command"] and [r["system"] for r in saved["rows"]] == ["async-pipeline k=2"]


def test_a_summary_prints_no_machine_path(tmp_path, monkeypatch, capsys):
    """What a bench prints goes into bench/results: a plot outside the repository is shown as /path/to/<name>."""
    import json

    runs = tmp_path / "runs"
    runs.mkdir()
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95}, **{"async/actor_train/busy_ratio": 1.0})
    (runs / "async-pipeline_k2_seed0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(e2e, "plot", lambda *args, **kwargs: None)
    monkeypatch.setattr(e2e.importlib.util, "find_spec", lambda name: object())  # as if matplotlib were there
    e2e.main(["--summarize-only", "--metrics-dir", str(runs), "--ks", "2", "--skip-verl", "--seeds", "0",
              "--png", str(tmp_path / "curve.png")])
    out = capsys.readouterr().out
    assert "plot: /path/to/curve.png" in out and str(tmp_path) not in out


def test_verls_legacy_trainer_is_a_baseline_the_pipeline_is_compared_with(tmp_path, monkeypatch, capsys):
    """--verl-v0: verl's legacy synchronous trainer runs with trainer.use_v1=False and each pipeline row names
    its time to the target against it."""
    import json

    runs = tmp_path / "runs"
    runs.mkdir()
    for name, step_s, reached, parts in (("verl-sync v0", 8.0, 4, {"timing_s/gen": 6.0}),
                                         ("async-pipeline k=2", 2.0, 2, {"async/actor_train/busy_ratio": 1.0})):
        rows = rows_for(step_s, e2e.VAL_KEYS[0], {0: 0.0, reached: 0.95}, **parts)
        e2e.metrics_file(runs, name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    started = []
    monkeypatch.setattr(e2e, "run_system", lambda name, *args, **kwargs: started.append((name, args[3])))
    e2e.main(["--summarize-only", "--metrics-dir", str(runs), "--ks", "2", "--skip-verl-sync", "--verl-v0",
              "--seeds", "0"])
    out = capsys.readouterr().out
    assert "against verl-sync v0: time to 0.9 4 s against 32 s (8.00x)" in out, out
    assert started == []  # summarized, not run
    e2e.main(["--metrics-dir", str(runs), "--reuse", "--ks", "2", "--skip-verl-sync", "--verl-v0", "--seeds", "0"])
    assert started == []  # both files there: nothing run again


def test_a_baseline_that_never_reaches_the_target_gives_a_lower_bound():
    verl, _ = e2e.summarize("verl-sync", None, rows_for(8.0, e2e.VAL_KEYS[1], {0: 0.0, 4: 0.3},
                                                        **{"timing_s/gen": 5.0}), 8, 0.5)
    pipe, _ = e2e.summarize("async-pipeline k=2", 2, rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.6}, **{
        "async/actor_train/busy_ratio": 1.0}), 8, 0.5)
    assert verl["time_to_target_s"] is None and verl["trained_s"] == pytest.approx(8.0 * verl["steps"])
    ratio, words = e2e.time_to_target_ratio(pipe, verl)
    assert ratio == pytest.approx(verl["trained_s"] / pipe["time_to_target_s"])
    assert "more than" in words and f"not reached in {verl['steps']} steps" in words
    assert e2e.time_to_target_ratio(verl, pipe)[0] is None  # the one that never reached it has no ratio


def test_across_seeds_means_the_seeds_reached_and_misses_the_goal_where_one_was_not():
    def run(system, seed, to_target, trained=400.0):
        return {"system": system, "seed": seed, "time_to_target_s": to_target, "trained_s": trained, "steps": 20}
    rows = [run("pipe", 0, 100.0), run("fa", 0, 200.0), run("pipe", 1, 300.0), run("fa", 1, None, 350.0),
            run("pipe", 2, None), run("fa", 2, 90.0), run("fa", 3, 90.0)]
    got = e2e.across_seeds(rows, "pipe", "fa")
    assert got["seeds"] == [0, 1, 2]  # seed 3 ran only one of them
    assert got["counted"] == [0, 1] and got["unreached"] == [2] and got["peer_unreached"] == [1]
    # where fa did not reach it, its whole training time (350 s) counts
    assert got["mean_s"] == pytest.approx(200.0) and got["peer_mean_s"] == pytest.approx(275.0)
    assert got["ratio"] == pytest.approx(1.375) and got["sooner"] == 2
    line = e2e.across_seeds_line(got, "pipe", "fa", 1.3)
    assert "200 s against 275 s (1.38x; 95% of seed resamples 1.17-2.00x); sooner on 2 of 2" in line
    # the interval: seed 0 alone 2.00x, seed 1 alone 350 / 300 = 1.17x, each a quarter of the resamples
    assert got["interval"] == (pytest.approx(350 / 300), pytest.approx(2.0))
    assert e2e.middle_95([100.0, 200.0, 50.0], [150.0, 300.0, 75.0]) == (pytest.approx(1.5), pytest.approx(1.5))
    assert e2e.middle_95([100.0], [150.0]) is None
    # a seed that reached it at 0 s (at step 1 logged): the resamples of it alone have no ratio and are left out
    low, high = e2e.middle_95([0.0, 100.0], [50.0, 150.0])
    assert low == pytest.approx(1.5) and high == pytest.approx(2.0)  # 150 / 100 and 200 / 100
    assert e2e.middle_95([0.0, 0.0], [50.0, 150.0]) is None
    assert "fa did not reach it on seeds [1]" in line and "pipe did not reach it on seeds [2]" in line
    # a seed the pipeline never reached the target on fails the goal, whatever the mean of the others
    assert line.endswith("1.38x >= 1.3x, not reached on seeds [2]: goal missed")
    reached = e2e.across_seeds([run("pipe", 0, 100.0), run("fa", 0, 140.0), run("pipe", 1, 100.0),
                                run("fa", 1, 110.0)], "pipe", "fa")
    assert e2e.across_seeds_line(reached, "pipe", "fa", 1.3).endswith(
        "(1.25x; 95% of seed resamples 1.10-1.40x); sooner on 2 of 2; a step 20.0 s against 20.0 (1.00x), the steps "
        "each took to it 1.25x; "
        "1.25x < 1.3x: goal missed")
    faster = e2e.across_seeds([run("pipe", 0, 100.0), run("fa", 0, 140.0)], "pipe", "fa")
    assert e2e.across_seeds_line(faster, "pipe", "fa", 1.3).endswith("1.40x >= 1.3x: goal met")
    assert "goal" not in e2e.across_seeds_line(faster, "pipe", "fa", None)
    assert e2e.across_seeds(rows, "pipe", "verl-sync") is None


def test_across_seeds_on_the_wall_clock_reads_the_wall_times_and_needs_them_for_every_run():
    def run(system, seed, to_target, wall_to_target, wall_trained=500.0, steps=11):
        return {"system": system, "seed": seed, "time_to_target_s": to_target, "trained_s": 400.0,
                "wall_to_target_s": wall_to_target, "wall_trained_s": wall_trained, "steps": steps}
    rows = [run("pipe", 0, 100.0, 150.0), run("fa", 0, 130.0, 240.0), run("pipe", 1, 100.0, 150.0),
            run("fa", 1, None, None, 330.0)]
    training = e2e.across_seeds(rows, "pipe", "fa")
    assert training["ratio"] == pytest.approx((130.0 + 400.0) / 2 / 100.0)
    wall = e2e.across_seeds(rows, "pipe", "fa", "wall s")  # fa's whole wall run where it did not reach it
    assert wall["mean_s"] == pytest.approx(150.0) and wall["peer_mean_s"] == pytest.approx(285.0)
    assert wall["peer_unreached"] == [1] and wall["sooner"] == 2
    # a step on the wall clock: the whole run over the steps after the first (50 s); on the step timers, over all
    assert wall["step_s"] == pytest.approx(50.0) and training["step_s"] == pytest.approx(400.0 / 11)
    rows[1]["wall_trained_s"], rows[3]["steps"] = 600.0, 7  # fa: 60 and 55 s a step
    line = e2e.across_seeds_line(e2e.across_seeds(rows, "pipe", "fa", "wall s"), "pipe", "fa", None)
    assert "a step 50.0 s against 57.5 (1.15x), the steps each took to it 1.65x" in line
    rows[3]["wall_trained_s"] = None  # a run without a cores log has no wall time: no wall comparison
    assert e2e.across_seeds(rows, "pipe", "fa", "wall s") is None
    assert e2e.across_seeds(rows, "pipe", "fa")["ratio"] == pytest.approx(training["ratio"])


def test_validations_are_keyed_by_the_updates_made_before_them_and_averaged_where_every_run_has_one():
    pipeline = {n: {"timing_s/step": 1.0, "training/global_step": n} for n in range(1, 7)}
    fully_async = {n + 1: {"timing_s/step": 1.0, "training/global_step": n} for n in range(1, 7)}  # update n at n + 1
    vals = {0: 0.0, 2: 0.2, 4: 0.4, 6: 0.6}
    assert e2e.val_by_update(pipeline, vals) == {0: 0.0, 2: 0.2, 4: 0.4, 6: 0.6}
    assert e2e.val_by_update(fully_async, vals) == {0: 0.0, 1: 0.2, 3: 0.4, 5: 0.6}
    assert e2e.val_by_update({1: {"timing_s/step": 1.0}}, {0: 0.1, 2: 0.3}) == {0: 0.1, 2: 0.3}  # no global step
    rows = [{"system": "fa", "val_by_update": {0: 0.0, 1: 0.2, 3: 0.4}},
            {"system": "fa", "val_by_update": {0: 0.1, 1: 0.3}},  # stopped at its target after 1 update
            {"system": "pipe", "val_by_update": {0: 0.0, 2: 0.5}}]
    assert e2e.mean_val_by_update(rows, "fa") == {0: pytest.approx(0.05), 1: pytest.approx(0.25)}
    assert e2e.mean_val_by_update(rows, "pipe") == {0: 0.0, 2: 0.5}
    assert e2e.mean_val_by_update(rows, "verl-sync") == {}


def test_wall_to_target_runs_from_step_1_logged_to_the_poll_that_saw_the_target():
    def poll(all_s, steps, best_val=None, **flag):
        return {"busy_s": all_s / 2, "all_s": all_s, "steps": steps, "best_val": best_val, **flag}
    samples = [poll(0.0, 0), poll(20.0, 1, 0.1), poll(60.0, 3, 0.2), poll(100.0, 4, 0.3), poll(140.0, 6, 0.5)]
    got = e2e.wall_to_target(samples, stopped_at_target=False, target=0.25, cores=2)
    assert got == {"wall_to_target_s": pytest.approx(40.0), "wall_trained_s": pytest.approx(60.0)}
    assert e2e.wall_to_target(samples, False, 0.25, cores=4)["wall_to_target_s"] == pytest.approx(20.0)
    # any target the polls' best validation reaches, read after the run
    assert e2e.wall_to_target(samples, False, 0.2, cores=2)["wall_to_target_s"] == pytest.approx(20.0)
    assert e2e.wall_to_target(samples, False, 0.4, cores=2)["wall_to_target_s"] == pytest.approx(60.0)
    assert e2e.wall_to_target(samples, False, 0.6, cores=2) == {"wall_to_target_s": None,
                                                               "wall_trained_s": pytest.approx(60.0)}
    # a poll recorded with only `reached` (against the run's own target) is read by that flag
    flagged = [{k: v for k, v in s.items() if k != "best_val"} | {"reached": s["best_val"] == 0.5} for s in samples]
    assert e2e.wall_to_target(flagged, False, 0.25, cores=2)["wall_to_target_s"] == pytest.approx(60.0)
    # a run stopped at the target stopped at the poll that saw it: its last
    unflagged = [{k: v for k, v in s.items() if k != "best_val"} for s in samples[:3]]
    assert e2e.wall_to_target(unflagged, True, 0.25, cores=2)["wall_to_target_s"] == pytest.approx(20.0)
    assert e2e.wall_to_target(unflagged, False, 0.25, cores=2)["wall_to_target_s"] is None
    assert e2e.wall_to_target([poll(0.0, 0)], True, 0.25, cores=2) == {"wall_to_target_s": None,
                                                                      "wall_trained_s": None}


def test_the_version_clock_ends_when_the_version_that_reached_the_target_was_trained():
    """Polls 10 wall s apart (2 cores), step n logged at poll n; the first validation at 0.3 is seen at the poll of
    wall 40 s. The pipeline names the version it validated (3: trained when step 3 was logged, wall 20 s);
    fully_async_policy's rollouter and the synchronous trainer time their validation of the version just trained."""
    samples = [{"busy_s": 0.0, "all_s": 20.0 * n, "steps": n, "best_val": 0.3 if n >= 5 else 0.1} for n in range(7)]
    steps = [{"step": n, "data": {"timing_s/step": 1.0, "training/global_step": n}} for n in range(1, 5)]
    val = e2e.VAL_KEYS[0]
    pipeline = [*steps, {"step": 4, "data": {val: 0.3, "val-aux/param_version": 3.0}}]
    got = e2e.version_to_target(pipeline, samples, stopped_at_target=False, target=0.25, cores=2)
    assert got == {"version_to_target_s": pytest.approx(20.0)}
    assert e2e.wall_to_target(samples, False, 0.25, cores=2)["wall_to_target_s"] == pytest.approx(40.0)
    fully_async = [*steps, {"step": 5, "data": {val: 0.3, "rollouter/validate_time": 6.0}}]
    assert e2e.version_to_target(fully_async, samples, False, 0.25, cores=2) == {"version_to_target_s": 34.0}
    sync = [*steps[:3], {"step": 4, "data": {**steps[3]["data"], val: 0.3, "timing_s/testing": 15.0}}]
    assert e2e.version_to_target(sync, samples, False, 0.25, cores=2) == {"version_to_target_s": 25.0}
    # no key that says when its version was trained, or the target not reached: no time on this clock
    unnamed = [*steps, {"step": 4, "data": {val: 0.3}}]
    assert e2e.version_to_target(unnamed, samples, False, 0.25, cores=2) == {}
    assert e2e.version_to_target(pipeline, samples, False, 0.5, cores=2) == {"version_to_target_s": None}
    # a validation that took longer than the clock had run counts from step 1 logged, never before it
    slow = [*steps, {"step": 5, "data": {val: 0.3, "rollouter/validate_time": 60.0}}]
    assert e2e.version_to_target(slow, samples, False, 0.25, cores=2) == {"version_to_target_s": 0.0}


TARGET_TRAINER = '''
import json, os, time
with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
    f.write(json.dumps({"step": 1, "data": {"timing_s/step": 0.5}}) + "\\n")
    f.flush()
    time.sleep(5)
    f.write(json.dumps({"step": 1, "data": {"val-core/async_rl/copy_digits/reward/mean@1": 0.9}}) + "\\n")
    f.flush()
    time.sleep(5)
'''


def test_each_poll_records_the_best_validation_so_far_without_stopping_the_run(tmp_path, monkeypatch):
    (tmp_path / "target_trainer.py").write_text(TARGET_TRAINER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    metrics = tmp_path / "metrics.jsonl"
    rows = e2e.run_system("runs on", tmp_path, tmp_path, metrics, {}, timeout_s=60, main="target_trainer")
    assert any("val-core/async_rl/copy_digits/reward/mean@1" in r["data"] for r in rows)
    best = [s["best_val"] for s in e2e.read_cores(metrics)]
    assert best[0] is None and best[-1] == 0.9  # seen at a poll, the run going on to its end
    assert best.count(0.9) >= 2 and set(best) == {None, 0.9}
    got = e2e.wall_to_target(e2e.read_cores(metrics), stopped_at_target=False, target=0.8)
    assert 3.0 <= got["wall_to_target_s"] <= got["wall_trained_s"]
    # stopping at the target: the run ends at the first poll that recorded it
    e2e.run_system("stops", tmp_path, tmp_path, metrics, {}, timeout_s=60, main="target_trainer", stop_at=0.8)
    best = [s["best_val"] for s in e2e.read_cores(metrics)]
    assert best[-1] == 0.9 and best.count(0.9) == 1


def test_the_slowest_step_is_timed_against_the_median_with_the_cores_busy_while_it_ran():
    step_s = {1: 30.0, 2: 7.0, 3: 22.0, 4: 8.0, 5: 6.0}  # step 1 (warm-up) is not counted
    samples = [{"steps": 1, "busy_s": 0.0, "all_s": 0.0}, {"steps": 2, "busy_s": 14.0, "all_s": 14.0},
               {"steps": 2, "busy_s": 20.0, "all_s": 26.0}, {"steps": 3, "busy_s": 26.0, "all_s": 38.0},
               {"steps": 5, "busy_s": 54.0, "all_s": 66.0}]
    got = e2e.slowest_step(step_s, samples)
    # step 3 ran from the first poll that saw step 2 to the first that saw step 3: 12 of 24 core-seconds busy
    assert got == {"step": 3, "s": 22.0, "median_s": 7.5, "cores_busy": 0.5}
    assert e2e.slowest_words(got) == "; slowest step 3: 22.0 s against a median of 7.5, cores busy 50% during it"
    assert e2e.slowest_step(step_s, [])["cores_busy"] is None  # no polls: the time only
    assert e2e.slowest_step({1: 5.0, 2: 6.0}, samples) is None and e2e.slowest_words(None) == ""


def test_the_update_right_after_a_validation_is_timed_per_token_against_the_other_steps():
    def step(n, update_s, response):
        return {"step": n, "data": {"timing_s/update_actor": update_s, "prompt_length/mean": 10.0,
                                    "response_length/mean": response}}
    # validation every 2 steps: steps 3 and 5 follow one; step 1 (warm-up) and a validation-only row do not count
    metrics = [step(1, 99.0, 10.0), step(2, 2.0, 10.0), step(3, 6.0, 20.0), step(4, 4.0, 30.0), step(5, 3.0, 10.0),
               {"step": 4, "data": {"val-core/x": 0.5}}]
    got = e2e.update_after_validation(metrics, 2)
    assert got["after_s"] == pytest.approx((6.0 / 30 + 3.0 / 20) / 2)
    assert got["others_s"] == pytest.approx((2.0 / 20 + 4.0 / 40) / 2)
    assert got["ratio"] == pytest.approx(got["after_s"] / got["others_s"])
    assert e2e.update_after_validation(metrics, -1) is None  # no validation during training
    assert e2e.update_after_validation(metrics[:2], 2) is None  # no step of one kind


def test_a_run_stops_at_its_first_validation_at_the_target_with_its_whole_process_group(tmp_path):
    import os
    import subprocess

    metrics = tmp_path / "m.jsonl"
    assert e2e.best_validation(metrics) is None
    metrics.write_text('{"step": 0, "data": {"%s": 0.5}}\n' % e2e.VAL_KEYS[0])
    assert e2e.best_validation(metrics) == 0.5
    with metrics.open("a") as f:
        f.write('{"step": 10, "data": {"%s": 0.9' % e2e.VAL_KEYS[1])  # a line the run is still writing
    assert e2e.best_validation(metrics) == 0.5
    with metrics.open("a") as f:
        f.write('2}}\n{"step": 12, "data": {"%s": 0.7}}\n' % e2e.VAL_KEYS[0])
    assert e2e.best_validation(metrics) == 0.92  # the best so far, not the last
    child_pid = tmp_path / "child"
    proc = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {child_pid}; wait"], start_new_session=True)
    for _ in range(100):
        if child_pid.exists() and child_pid.read_text().strip():
            break
        __import__("time").sleep(0.05)
    e2e.stop_like_a_scheduler(proc, kill_wait_s=5)
    assert proc.poll() is not None
    child = int(child_pid.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(50):  # the background sleep was in the session: it is gone (or a zombie being reaped)
            os.kill(child, 0)
            __import__("time").sleep(0.1)
        raise AssertionError("the run's child process outlived the stop")


def test_the_pictures_title_names_verl_only_where_a_curve_is_verls():
    assert e2e.plot_title("lookup", 4, with_verl=False) == "lookup agent, 2-4 turns: async pipeline"
    assert e2e.plot_title("copy", 4, with_verl=True).endswith("verl vs async pipeline")


FAKE_TRAINER = '''
import json, os, time
open(os.path.join(os.path.dirname(os.environ["VERL_FILE_LOGGER_PATH"]), "pid"), "w").write(str(os.getpid()))
with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as f:
    for step in (1, 2):
        f.write(json.dumps({"step": step, "data": {"timing_s/step": 0.5}}) + "\\n")
time.sleep(600)
'''


def test_a_run_past_its_bound_is_stopped_and_its_rows_kept(tmp_path, monkeypatch, capsys):
    """A run still going at --timeout-s (a system that does not reach the target in it) is ended like a
    scheduler ends a job, and the steps it logged are summarized rather than lost in an error."""
    (tmp_path / "fake_trainer.py").write_text(FAKE_TRAINER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    metrics = tmp_path / "metrics.jsonl"
    rows = e2e.run_system("slow system", tmp_path, tmp_path, metrics, {}, timeout_s=3.0, main="fake_trainer")
    assert [r["step"] for r in rows] == [1, 2]
    assert "slow system: stopped at --timeout-s 3 s" in capsys.readouterr().out
    samples = e2e.read_cores(metrics)  # a poll every POLL_S: the machine's CPU and the steps logged by then
    assert samples and samples[-1]["steps"] == 2
    assert all(0 < s["busy_s"] <= s["all_s"] for s in samples)
    assert [s["all_s"] for s in samples] == sorted(s["all_s"] for s in samples)
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # ended, and reaped by run_system
        os.kill(pid, 0)


def test_a_run_that_falls_after_the_target_is_reported_as_not_held():
    """`held_target`: the first validation at the target, the lowest one after it; a run that dips below it
    after reaching it (the LoRA demo's collapse: 1.0 to 0.08) is not held, one that stays is."""
    fell = e2e.held_target({0: 0.0, 10: 0.93, 20: 1.0, 30: 0.39, 40: 0.08, 50: 0.09}, 0.9)
    assert fell == {"target_step": 10, "min_val_after_target": 0.08, "min_val_step": 40, "held": False,
                    "vals_below_after_target": 3, "settled_step": None}
    stayed = e2e.held_target({0: 0.0, 10: 0.5, 20: 0.9, 30: 1.0, 40: 0.95}, 0.9)
    assert stayed == {"target_step": 20, "min_val_after_target": 0.9, "min_val_step": 20, "held": True,
                      "vals_below_after_target": 0, "settled_step": 20}
    # one dip at the crossing, then back to stay: not held, settled from the validation after the dip
    dipped = e2e.held_target({0: 0.0, 130: 0.91, 140: 0.87, 150: 0.97, 160: 1.0}, 0.9)
    assert (dipped["held"], dipped["vals_below_after_target"], dipped["settled_step"]) == (False, 1, 150)
    assert e2e.held_target({0: 0.0, 10: 0.5}, 0.9)["held"] is None
    rows = rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 2: 0.95, 4: 0.5},
                    **{"prompt_length/mean": 6.0, "async/actor_train/busy_ratio": 0.9})
    row, _ = e2e.summarize("async-pipeline k=2 LoRA", 2, rows, samples_per_step=8, target=0.9)
    row["seed"] = 1
    assert row["held"] is False and row["tokens_per_step"] == pytest.approx(8 * (6.0 + 10.0))
    assert e2e.held_line(row, 0.9) == ("async-pipeline k=2 LoRA seed 1: reached 0.9 at step 2, then fell to 0.500 at "
                                       "step 4; below 0.9 at its last validation")
    row.update(e2e.held_target({0: 0.0, 2: 0.95, 4: 0.5, 6: 0.92}, 0.9))
    assert e2e.held_line(row, 0.9) == ("async-pipeline k=2 LoRA seed 1: reached 0.9 at step 2, then fell to 0.500 at "
                                       "step 4 (1 validation(s) below 0.9); >= 0.9 from step 6 to its last")


def test_a_runs_engine_patches_are_those_every_engine_process_applied(tmp_path):
    """What the results state per system: the CPU patches applied in each process that loaded verl's FSDP
    engine (the patch log `run_system` has the run write); a process without the engine is not counted."""
    import json

    metrics = tmp_path / "run_seed0.jsonl"
    entries = [(1, "patch_unpinned_cpu_offload"), (1, "patch_sdpa_attention"), (1, "patch_row_block_logprobs"),
               (2, "patch_unpinned_cpu_offload"), (2, "patch_sdpa_attention"), (3, "patch_master_port")]
    e2e.patch_log_of(metrics).write_text("".join(json.dumps({"pid": pid, "patch": name, "module": "m"}) + "\n"
                                                 for pid, name in entries))
    assert e2e.engine_patches(metrics) == {"engine_processes": 2, "cpu_patches": ["sdpa_attention",
                                                                                 "unpinned_cpu_offload"]}
    assert e2e.engine_patches(tmp_path / "other_seed0.jsonl") == {"engine_processes": 0, "cpu_patches": []}


def test_verls_fully_async_rollouter_keeps_the_tasks_agent_loop_under_the_bench_settings(demo_dir):
    """verl's fully_async rollouter (`prepare_single_generation_data`) gives every training sample verl's
    `single_turn_agent` unless `multi_turn.enable` is set, whatever agent loop the task names: the lookup
    agent then trains without its tool (2 turns a trajectory) while its validation calls it. The bench's
    fully_async settings keep the task's agent loop."""
    import numpy as np
    import torch
    import verl
    from hydra import compose, initialize_config_dir
    from verl.experimental.fully_async_policy.detach_utils import prepare_single_generation_data

    from async_rl.demo import demo_overrides

    def agent_names(settings: dict):
        overrides = [o for o in demo_overrides(demo_dir, extra=settings, agent=True) if not o.startswith(e2e.PIPELINE_KEYS)]
        config_dir = os.path.join(os.path.dirname(verl.__file__), "experimental", "fully_async_policy", "config")
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            config = compose("fully_async_ppo_trainer", overrides=overrides)
        row = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "raw_prompt": np.array([[{"role": "user"}]], dtype=object)}
        batch = prepare_single_generation_data(row, config)
        assert len(batch) == int(config.actor_rollout_ref.rollout.n)  # the prompt's group
        return set(batch.non_tensor_batch.get("agent_name", [None]))

    settings = e2e.fully_async_overrides(steps=3, prompts_per_step=32)
    assert agent_names(settings) == {None}  # verl's AgentLoopManager then runs default_agent_loop: lookup
    assert agent_names({**settings, "actor_rollout_ref.rollout.multi_turn.enable": False}) == {"single_turn_agent"}


def test_the_commit_a_bench_names_is_heads_and_says_when_files_differ(tmp_path):
    import subprocess

    from bench import command

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=command.ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert command.commit().removesuffix("+changes") == head
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *a], cwd=repo, check=True,  # noqa: E731
                                    capture_output=True)
    git("init", "-q")
    (repo / "f").write_text("a")
    git("add", "f")
    git("commit", "-q", "-m", "c")
    assert not command.commit(repo).endswith("+changes")
    (repo / "f").write_text("b")
    assert command.commit(repo).endswith("+changes")
    assert command.commit(tmp_path / "nowhere") == "unknown"


def verl_and_pipeline(verl_reached=4, pipe_reached=2):
    """verl-sync: gen 6 + old_log_prob 1 + update 2 + weight sync 1 of a 12 s step; the pipeline: 8 s steps."""
    parts = {"timing_s/gen": 6.0, "timing_s/old_log_prob": 1.0, "timing_s/update_actor": 2.0,
             "timing_s/update_weights": 1.0}
    verl_vals = {0: 0.0, 4: 0.95 if verl_reached else 0.5}
    verl, _ = e2e.summarize("verl-sync", None, rows_for(12.0, e2e.VAL_KEYS[1], verl_vals, **parts), 8, 0.9)
    pipe, _ = e2e.summarize("async-pipeline k=2", 2, rows_for(8.0, e2e.VAL_KEYS[0], {0: 0.0, pipe_reached: 0.95}, **{
        "async/actor_train/busy_ratio": 1.0}), 8, 0.9)
    verl["seed"] = pipe["seed"] = 0
    return verl, pipe


def test_the_overlap_limit_and_the_compute_share_come_from_verls_parts():
    verl, _ = verl_and_pipeline()
    assert e2e.training_side(verl["breakdown"]) == pytest.approx(4.0)  # log-prob 1 + update 2 + weight sync 1
    assert e2e.overlap_limit(verl["breakdown"]) == pytest.approx(10.0 / 6.0)  # (6 + 4) / max(6, 4)
    assert e2e.overlap_limit({**verl["breakdown"], "generation": 2.0}) == pytest.approx(6.0 / 4.0)  # training larger
    assert e2e.compute_share(verl) == pytest.approx(9.0 / 12.0)  # weight sync is not compute
    line = e2e.limit_line(verl)
    assert ("overlap limit (generation + training) / max(generation, training) = (6.00 + 4.00) / 6.00 = 1.67, "
            "training = log-prob passes 1.00 + update 2.00 + weight sync 1.00") in line
    assert ("(generation + log-prob passes + update) / step = (6.00 + 1.00 + 2.00) / 12.00 = 0.75 (>= 0.70; the whole "
            "generation phase counted as compute)") in line
    low = {**verl, "mean_step_s": 20.0}
    assert "/ 20.00 = 0.45 (< 0.70" in e2e.limit_line(low)
    nothing = {**verl, "breakdown": {p: 0.0 for p in verl["breakdown"]}}
    assert e2e.overlap_limit(nothing["breakdown"]) is None and "no overlap limit" in e2e.limit_line(nothing)


def test_each_run_is_measured_against_verls_overlap_limit():
    verl, pipe = verl_and_pipeline()
    pipe["mean_step_s"] = 7.5
    got = e2e.against_limit(pipe, verl)
    assert got["per_step"] == pytest.approx(12.0 / 7.5)
    assert got["per_step_of_limit"] == pytest.approx(1.6 / (10.0 / 6.0))  # 0.96
    assert got["to_target"] == pytest.approx(48.0 / 16.0) and got["to_target_of_limit"] == pytest.approx(3.0 * 0.6)
    assert e2e.against_limit_line(pipe, verl) == (
        "  async-pipeline k=2 seed 0 against verl-sync: 1.60x per step (12.00 s / 7.50 s), 0.96 of the overlap limit "
        "1.67 (goal 0.9: met); time to 0.9: 3.00x (48 s / 16 s), 1.80 of the overlap limit")
    pipe["mean_step_s"] = 10.0  # 1.2x a step: 0.72 of the limit
    assert "0.72 of the overlap limit 1.67 (goal 0.9: missed);" in e2e.against_limit_line(pipe, verl)
    # k = 1 trains each batch after generating it, by design: no verdict
    assert "goal" not in e2e.against_limit_line({**pipe, "generate_ahead_steps": 1}, verl)
    verl, pipe = verl_and_pipeline(verl_reached=None)
    assert e2e.against_limit(pipe, verl)["to_target"] is None
    assert e2e.against_limit_line(pipe, verl).endswith("time to 0.9: not compared (verl-sync did not reach it)")


def test_the_cores_busy_are_measured_from_step_one_to_the_last_step_and_bound_the_same_cores():
    """Polls before step 1 (start-up) and after the last step (the run ending) are left out; verl's run at 40% of
    the cores bounds a system doing its work on the same cores at 1 / 0.4 = 2.5x."""
    samples = [{"busy_s": 0.0, "all_s": 0.0, "steps": 0}, {"busy_s": 9.0, "all_s": 10.0, "steps": 0},
               {"busy_s": 10.0, "all_s": 20.0, "steps": 1}, {"busy_s": 13.0, "all_s": 30.0, "steps": 2},
               {"busy_s": 18.0, "all_s": 40.0, "steps": 4}, {"busy_s": 28.0, "all_s": 50.0, "steps": 4}]
    assert e2e.cores_busy(samples) == pytest.approx((18.0 - 10.0) / (40.0 - 20.0))
    assert e2e.cores_busy(samples[:3]) is None  # one step: no window after the first
    assert e2e.cores_busy([]) is None
    verl, pipe = verl_and_pipeline()
    assert e2e.same_cores_limit(verl) is None
    verl.update(e2e.cpu_use(samples, verl["mean_step_s"], cores=2))
    assert e2e.same_cores_limit(verl) == pytest.approx(2.5) and verl["cpu_s_per_step"] == pytest.approx(0.4 * 2 * 12.0)
    assert "CPU a step" not in e2e.against_limit_line(pipe, verl)  # the pipeline's not recorded
    pipe.update(e2e.cpu_use([{**s, "busy_s": s["all_s"] * 0.8} for s in samples], pipe["mean_step_s"], cores=2))
    # 1.5x per step = 9.6 / 12.8 CPU-s a step (0.75x: more work) x 80% / 40% of the cores (2x)
    assert ("1.50x = CPU a step 9.6 / 12.8 CPU-s (0.75x) x cores busy 80% / 40% (2.00x)"
            in e2e.against_limit_line(pipe, verl))
    busy, every = e2e.machine_cpu_s()
    assert 0 < busy <= every


def test_the_long_task_prints_the_limit_and_each_runs_fraction_of_it(tmp_path, monkeypatch, capsys):
    import json

    runs = tmp_path / "runs"
    runs.mkdir()
    parts = {"timing_s/gen": 6.0, "timing_s/old_log_prob": 1.0, "timing_s/update_actor": 2.0,
             "timing_s/update_weights": 1.0}
    for name, step_s, metrics in (("verl-sync", 12.0, parts), ("async-pipeline k=2", 8.0,
                                                             {"async/actor_train/busy_ratio": 1.0})):
        rows = rows_for(step_s, e2e.VAL_KEYS[-1], {0: 0.0, 4: 0.95}, **metrics)  # the long task's validation key
        e2e.metrics_file(runs, name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    e2e.cores_log_of(e2e.metrics_file(runs, "verl-sync")).write_text("".join(  # half the cores busy over its steps
        json.dumps({"busy_s": 10.0 * i, "all_s": 20.0 * i, "steps": i}) + "\n" for i in range(5)))
    monkeypatch.setattr(e2e, "plot", lambda *args, **kwargs: None)
    e2e.main(["--summarize-only", "--metrics-dir", str(runs), "--ks", "2", "--seeds", "0", "--task", "long",
              "--model-size", "small", "--json", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert "task long; model small (hidden 256, MLP 1024, 4 layers, 1 attention head(s))" in out
    assert "verl-sync seed 0: overlap limit (generation + training) / max(generation, training) = (6.00 + 4.00)" in out
    assert "async-pipeline k=2 seed 0 against verl-sync: 1.50x per step (12.00 s / 8.00 s), 0.90 of the overlap" in out
    assert (f"verl-sync seed 0: 50% of the cores, {0.5 * os.cpu_count() * 12.0:.1f} CPU-s a step; same-cores limit "
            "1 / 0.50 = 2.00") in out
    assert "async-pipeline k=2 seed 0: not recorded" in out
    saved = {r["system"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert saved["verl-sync"]["overlap_limit"] == pytest.approx(10 / 6) and saved["verl-sync"]["compute_share"] == 0.75
    assert saved["async-pipeline k=2"]["overlap_limit"] is None
    with pytest.raises(SystemExit):  # the tiny model's positions do not hold 256-token responses
        e2e.main(["--summarize-only", "--metrics-dir", str(runs), "--task", "long", "--model-size", "tiny"])
    with pytest.raises(SystemExit):
        e2e.main(["--summarize-only", "--metrics-dir", str(runs), "--model-size", "huge"])
    assert e2e.plot_title("long", 4, with_verl=True).startswith("copy-digits, long-tailed responses up to 256")


ARGV_TRAINER = '''
import json, os, sys
open(os.path.join(os.path.dirname(os.environ["VERL_FILE_LOGGER_PATH"]), "argv"), "w").write(json.dumps(sys.argv[1:]))
open(os.environ["VERL_FILE_LOGGER_PATH"], "a").write(json.dumps({"step": 1, "data": {"timing_s/step": 0.5}}) + "\\n")
'''


def test_a_long_task_run_gets_the_long_tasks_overrides(tmp_path, monkeypatch):
    import json

    from async_rl.demo import demo_overrides

    (tmp_path / "argv_trainer.py").write_text(ARGV_TRAINER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    e2e.run_system("verl-sync", tmp_path, tmp_path, tmp_path / "m.jsonl", {}, timeout_s=60, main="argv_trainer",
                   task="long")
    argv = json.loads((tmp_path / "argv").read_text())
    assert argv == demo_overrides(tmp_path, long=True)
    assert "actor_rollout_ref.rollout.agent.default_agent_loop=long_tail" in argv
    assert "data.max_response_length=256" in argv


@pytest.mark.parametrize("ranks", [2, 4])
def test_train_ranks_split_the_same_cores_into_that_many_train_ranks_and_one_rollout_server(ranks):
    from async_rl.core.placement import plan_placement

    keys = e2e.train_split(ranks)
    assert keys["trainer.n_gpus_per_node"] == ranks + 1
    ratios = dict(zip(("train", "logp", "ref_logp", "generate"), keys["+trainer.use_nodes_ratios"]))
    placement = plan_placement(1, ranks + 1, ratios, ["train"], 1)
    assert placement.groups["train"].count == ranks and len(placement.replicas) == 1


def test_train_and_verl_ranks_reach_each_systems_keys(tmp_path, monkeypatch):
    """--train-ranks crosses --ks (1: the demo's split, no keys added), --verl-ranks sets verl-sync's devices."""
    import async_rl.demo

    runs = {}

    def run_system(name, demo_dir, workdir, path, extra, *args, **kwargs):
        runs[name] = extra
        return rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95},
                        **{"timing_s/gen": 1.0, "async/actor_train/busy_ratio": 1.0})  # verl's parts, a stage's busy

    monkeypatch.setattr(e2e, "run_system", run_system)
    monkeypatch.setattr(async_rl.demo, "prepare", lambda demo_dir, **kwargs: demo_dir.mkdir())
    e2e.main(["--ks", "1,2", "--train-ranks", "1,2", "--verl-ranks", "4", "--seeds", "0", "--metrics-dir",
              str(tmp_path)])
    assert list(runs) == ["verl-sync", "async-pipeline k=1", "async-pipeline k=1 train x2", "async-pipeline k=2",
                          "async-pipeline k=2 train x2"]
    assert runs["verl-sync"]["trainer.n_gpus_per_node"] == 4
    assert "trainer.n_gpus_per_node" not in runs["async-pipeline k=2"]
    assert runs["async-pipeline k=2 train x2"]["+trainer.use_nodes_ratios"] == [2 / 3, 2 / 3, 2 / 3, 1 / 3]
    assert runs["async-pipeline k=2 train x2"]["+trainer.generate_ahead_steps"] == 2
    assert not any("actor_rollout_ref.rollout.tensor_model_parallel_size" in extra for extra in runs.values())
    runs.clear()  # --verl-tp: one replica over that many of verl's ranks, in verl's runs only, named by it
    e2e.main(["--ks", "2", "--verl-tp", "2", "--seeds", "0", "--metrics-dir", str(tmp_path / "tp")])
    assert list(runs) == ["verl-sync tp2", "async-pipeline k=2"]
    assert runs["verl-sync tp2"]["actor_rollout_ref.rollout.tensor_model_parallel_size"] == 2
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size" not in runs["async-pipeline k=2"]
    runs.clear()  # --verl-admission-window-ms: the CPU engine's window in verl's runs only, named by it
    e2e.main(["--ks", "2", "--verl-admission-window-ms", "300", "--seeds", "0", "--metrics-dir", str(tmp_path / "w")])
    assert list(runs) == ["verl-sync window 300 ms", "async-pipeline k=2"]
    assert runs["verl-sync window 300 ms"][e2e.ADMISSION_WINDOW] == 300
    assert e2e.ADMISSION_WINDOW not in runs["async-pipeline k=2"]
    runs.clear()  # --loglinear-ks: pi_prox interpolated, on the same split of train ranks as --ks
    e2e.main(["--ks", "2", "--loglinear-ks", "2", "--train-ranks", "2", "--seeds", "0", "--metrics-dir",
              str(tmp_path / "loglinear")])
    assert list(runs) == ["verl-sync", "async-pipeline k=2 train x2", "async-pipeline k=2 loglinear train x2"]
    loglinear, recompute = runs["async-pipeline k=2 loglinear train x2"], runs["async-pipeline k=2 train x2"]
    assert loglinear == {**recompute, "+algorithm.proximal_logp_method": "loglinear"}
    runs.clear()  # --update-forward-ks: pi_prox the update's forward, likewise
    e2e.main(["--ks", "", "--update-forward-ks", "2", "--train-ranks", "2", "--seeds", "0", "--metrics-dir",
              str(tmp_path / "update_forward")])
    assert list(runs) == ["verl-sync", "async-pipeline k=2 update forward train x2"]
    assert runs["async-pipeline k=2 update forward train x2"] == {**recompute,
                                                                  "+algorithm.proximal_logp_method": "update_forward"}


@pytest.mark.parametrize("ranks", [1, 2])
def test_fully_async_train_ranks_set_its_trainers_devices_and_it_runs_verls_fully_async_main(tmp_path, monkeypatch,
                                                                                            ranks):
    """--fully-async-train-ranks N: fully_async_policy's trainer on N devices (its own entry point), named apart
    when N > 1, and the pipeline compared against it."""
    import async_rl.demo

    runs = {}

    def run_system(name, demo_dir, workdir, path, extra, timeout_s, critic, stop_at, entry, **kwargs):
        runs[name] = (extra, entry)
        return rows_for(2.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95},
                        **{"timing_s/gen": 1.0, "async/actor_train/busy_ratio": 1.0})

    monkeypatch.setattr(e2e, "run_system", run_system)
    monkeypatch.setattr(async_rl.demo, "prepare", lambda demo_dir, **kwargs: demo_dir.mkdir())
    e2e.main(["--rollout", "vllm", "--ks", "2", "--skip-verl-sync", "--fully-async-train-ranks", str(ranks),
              "--seeds", "0", "--metrics-dir", str(tmp_path)])
    name = "verl-fully-async" + (" train x2" if ranks == 2 else "")
    assert list(runs) == [name, "async-pipeline k=2"]
    extra, entry = runs[name]
    assert extra["trainer.n_gpus_per_node"] == ranks and extra["rollout.n_gpus_per_node"] == 1
    assert entry == e2e.FULLY_ASYNC_MAIN and runs["async-pipeline k=2"][1] == e2e.VERL_MAIN


def test_several_seeds_print_the_mean_against_fully_async_with_the_goals_verdict(tmp_path, monkeypatch, capsys):
    import async_rl.demo

    def run_system(name, demo_dir, workdir, path, extra, timeout_s, critic, stop_at, entry, **kwargs):
        step_s = 4.0 if name.startswith(e2e.FULLY_ASYNC) else 2.0  # both reach it at step 4
        return rows_for(step_s, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95},
                        **{"timing_s/gen": 1.0, "async/actor_train/busy_ratio": 1.0})

    monkeypatch.setattr(e2e, "run_system", run_system)
    monkeypatch.setattr(async_rl.demo, "prepare", lambda demo_dir, **kwargs: demo_dir.mkdir())
    e2e.main(["--rollout", "vllm", "--ks", "2", "--skip-verl-sync", "--seeds", "0,1", "--metrics-dir", str(tmp_path)])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "async-pipeline k=2 against verl-fully-async, 2 seeds" in line)
    assert "(2.00x; 95% of seed resamples 2.00-2.00x); sooner on 2 of 2; a step 2.0 s against 4.0 (2.00x), the steps each took to it 1.00x; 2.00x >= 1.3x: goal met" in line
    assert "in wall s" not in out  # no cores log: no wall clock
    # both validated after 0 and 4 updates on both seeds (rows_for: updates 1-4 without a global step logged)
    assert "  async-pipeline k=2: 0: 0.000, 4: 0.950" in out
    e2e.main(["--rollout", "vllm", "--ks", "2", "--skip-verl-sync", "--seeds", "0", "--metrics-dir", str(tmp_path)])
    assert "across seeds" not in capsys.readouterr().out  # one seed: the per-seed line says it all


def test_several_seeds_print_the_wall_clock_where_validation_outside_a_step_timer_counts(tmp_path, monkeypatch,
                                                                                          capsys):
    """verl-fully-async's step timers are faster here (4 s against the pipeline's 5 s: 1.25x slower), but its wall
    time to the target, read from its cores log, is 1.5x the pipeline's: the wall verdict says so."""
    import json

    import async_rl.demo

    def run_system(name, demo_dir, workdir, path, extra, timeout_s, critic, stop_at, entry, **kwargs):
        fully_async = name.startswith(e2e.FULLY_ASYNC)
        wall_s = 30.0 if fully_async else 20.0  # a step, on the bench's clock
        e2e.cores_log_of(path).write_text("".join(
            json.dumps({"busy_s": 1.0, "all_s": 2 * wall_s * n, "steps": n, "reached": n >= 4}) + "\n"
            for n in range(5)))
        rows = rows_for(4.0 if fully_async else 5.0, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95},
                        **{"timing_s/gen": 1.0, "async/actor_train/busy_ratio": 1.0})
        # fully_async's rollouter validated for 10 s before logging the step; the pipeline names the version
        rows[4]["data"].update({"rollouter/validate_time": 10.0} if fully_async else {"val-aux/param_version": 4.0})
        return rows

    monkeypatch.setattr(e2e, "run_system", run_system)
    monkeypatch.setattr(e2e.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(async_rl.demo, "prepare", lambda demo_dir, **kwargs: demo_dir.mkdir())
    e2e.main(["--rollout", "vllm", "--ks", "2", "--skip-verl-sync", "--seeds", "0,1", "--metrics-dir", str(tmp_path),
              "--no-stop-at-target"])
    out = capsys.readouterr().out.split("in wall s")
    assert len(out) == 2, "one block on the wall clock"
    training = next(line for line in out[0].splitlines() if "k=2 against verl-fully-async, 2 seeds" in line)
    wall = next(line for line in out[1].splitlines() if "k=2 against verl-fully-async, 2 seeds" in line)
    assert "(0.80x)" in training and training.endswith("goal missed")
    assert ("60 s against 90 s (1.50x; 95% of seed resamples 1.50-1.50x); sooner on 2 of 2; a step 20.0 s against 30.0 (1.50x), the steps each took "
            "to it 1.00x; 1.50x >= 1.3x: goal met") in wall
    version = out[1].split("in version wall s")[1]
    assert ("60 s against 80 s (1.33x; 95% of seed resamples 1.33-1.33x); sooner on 2 of 2; a step 20.0 s against 30.0 (1.50x), the steps each took "
            "to it 0.89x; 1.33x >= 1.3x: goal met") in version


def test_each_system_has_its_trainer_and_the_ppo_runs_are_compared_with_verls_ppo_run(tmp_path, monkeypatch, capsys):
    """The systems carry their trainer and whether they train a critic: the PPO runs (`--ppo-ks`) are run with a
    critic and compared with verl-sync PPO, naive PPO (no critic) with verl-sync; verl-sync alone gives the
    overlap limit, and its saved row names its trainer."""
    import json

    import async_rl.demo

    critics = {}

    def run_system(name, demo_dir, workdir, path, extra, timeout_s, critic, stop_at, entry, **kwargs):
        critics[name] = critic
        step_s = 4.0 if name.startswith("verl") else 2.0
        return rows_for(step_s, e2e.VAL_KEYS[0], {0: 0.0, 4: 0.95},
                        **{"timing_s/gen": 1.0, "timing_s/update_actor": 1.0, "async/actor_train/busy_ratio": 1.0})

    monkeypatch.setattr(e2e, "run_system", run_system)
    monkeypatch.setattr(async_rl.demo, "prepare", lambda demo_dir, **kwargs: demo_dir.mkdir())
    e2e.main(["--ks", "", "--naive-ks", "2", "--ppo-ks", "2", "--seeds", "0", "--metrics-dir", str(tmp_path),
              "--json", str(tmp_path / "out.json")])
    assert critics == {"verl-sync": False, "async-pipeline k=2 naive PPO": False, "verl-sync PPO": True,
                       "async-pipeline k=2 PPO": True}
    out = capsys.readouterr().out
    assert "async-pipeline k=2 naive PPO seed 0: 2.00x per sample; verl-sync's step" in out
    assert "async-pipeline k=2 PPO seed 0: 2.00x per sample; verl-sync PPO's step" in out
    limits = [line for line in out.splitlines() if "overlap limit" in line and line.startswith("verl-sync")]
    assert len(limits) == 1 and limits[0].startswith("verl-sync seed 0"), limits
    saved = {r["system"]: r for r in json.loads((tmp_path / "out.json").read_text())["rows"]}
    assert saved["verl-sync PPO"]["trainer"] == "verl-sync" and saved["verl-sync PPO"]["critic"] is True
    assert saved["verl-sync"]["overlap_limit"] is not None and saved["verl-sync PPO"]["overlap_limit"] is None


def test_summarize_only_names_the_run_missing_from_the_metrics_dir(tmp_path, capsys):
    with pytest.raises(SystemExit):
        e2e.main(["--ks", "2", "--skip-verl-sync", "--seeds", "0", "--metrics-dir", str(tmp_path), "--summarize-only"])
    err = capsys.readouterr().err
    assert "no metrics of async-pipeline k=2 seed 0 in --metrics-dir" in err and "run it with --reuse" in err
