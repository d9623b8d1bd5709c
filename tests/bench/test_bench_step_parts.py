"""bench/step_parts.py and its probe: a step split into parts that sum to it, from spans and CPU samples (no runs)."""

import asyncio
import json

import pytest

from bench import step_parts, step_probe


def write_run(out, spans_by_pid, cmdlines, cpu_by_pid, machine, times):
    """A run's raw files as run_system leaves them: spans per process, CPU samples, a log."""
    (out / "spans").mkdir(parents=True)
    for pid, spans in spans_by_pid.items():
        (out / "spans" / f"spans-{pid}.jsonl").write_text("".join(json.dumps(list(s)) + "\n" for s in spans))
    (out / "cpu.json").write_text(json.dumps({
        "times": times, "machine": machine, "ncpu": 2, "cmdlines": {str(k): v for k, v in cmdlines.items()},
        "cpu": {str(pid): [[i, v] for i, v in enumerate(series)] for pid, series in cpu_by_pid.items()}}))
    (out / "log.txt").write_text("(RewardLoopWorker pid=7) started\n")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"response_length/mean": 3.5}}) + "\n")


def verl_step(t0):
    """One synchronous step of verl, 10 s: dispatch 1 s, generation until t0 + 5 (last sample), the poll until 7,
    old log-prob 1 s, update 1 s, weight sync 0.5 s, 0.5 s no span covers."""
    return [("timer/step", t0, t0 + 10, None, {}), ("prepare_step", t0, t0 + 1, 0.1, {}),
            ("timer/gen", t0 + 1, t0 + 7, None, {}), ("replay_buffer_sample", t0 + 1, t0 + 7, 0.1, {}),
            ("timer/old_log_prob", t0 + 7, t0 + 8, None, {}), ("timer/update_actor", t0 + 8, t0 + 9, None, {}),
            ("timer/update_weights", t0 + 9, t0 + 9.5, None, {})]


def test_verl_sync_step_parts_sum_to_the_step_and_generation_splits_by_core_share(tmp_path):
    # samples every second over two steps (t = 0..20); the agent-loop worker busy on one core during generation
    # (1..5 s of each step), the rollout server a quarter core of which its forwards' spans report half
    times = [float(t) for t in range(21)]
    worker = [0.0]
    server = [0.0]
    machine_busy, machine_idle = [0.0], [0.0]
    for t in range(1, 21):
        generating = 1 <= (t - 1) % 10 < 5
        worker.append(worker[-1] + (1.0 if generating else 0.0))
        server.append(server[-1] + (0.25 if generating else 0.0))
        busy = (1.0 + 0.25 + 0.5) if generating else 0.5  # the rest of the machine: 0.5 core all along
        machine_busy.append(machine_busy[-1] + busy)
        machine_idle.append(machine_idle[-1] + 2.0 - busy)
    loops = [("agent_loop_sample", t0 + 1.5, t0 + 5, None, {}) for t0 in (0, 10)]
    forwards = [("engine_decode", t0 + 2, t0 + 4, 0.25, {}) for t0 in (0, 10)]
    forwards += [("engine_forward", t0 + 2, t0 + 4, 0.25, {"decode_rows": 8, "prefill_rows": 2, "prefill_tokens": 20})
                 for t0 in (0, 10)]
    write_run(tmp_path, {1: verl_step(0) + verl_step(10), 2: loops, 3: forwards},
              {1: "ray::TaskRunnerV1", 2: "ray::AgentLoopWorkerTQ", 3: "ray::CPURolloutServer"},
              {2: worker, 3: server}, [list(x) for x in zip(machine_busy, machine_idle)], times)
    result = step_parts.analyze("verl-sync", tmp_path, warmup=0)
    parts = result["parts"]
    assert result["step_s"] == pytest.approx(10.0) and result["steps"] == 2
    assert sum(parts.values()) == pytest.approx(10.0)
    assert parts["dispatch the batch (prepare_step: dataloader, TransferQueue, agent-loop manager)"] == pytest.approx(1)
    assert parts["verl's replay buffer: polling after the last sample (ReplayBuffer.sample, 2-s sleeps)"] == \
        pytest.approx(2.0)  # the last sample at 5, the poll returned at 7
    phase = lambda name: sum(v for k, v in parts.items() if k.startswith(name + ": "))  # noqa: E731
    assert phase("old log-prob pass") == phase("actor update") == pytest.approx(1.0)  # split by core shares too
    assert parts["old log-prob pass: other processes on the machine"] == pytest.approx(0.5 / 2)
    assert parts["rest of the step (unnamed)"] == pytest.approx(0.5)
    # generation 1..5 s: 8 core-seconds, of which the worker 4, the server 1 (0.5 forwards), the machine 2, idle 1
    assert parts["generation: agent-loop worker"] == pytest.approx(4 * 4 / 8)
    assert parts["generation: rollout server: engine decode forwards"] == pytest.approx(4 * 0.25 / 8)
    assert parts["generation: rollout server: request handling and its event loop"] == pytest.approx(4 * 0.75 / 8)
    assert parts["generation: other processes on the machine"] == pytest.approx(4 * 2 / 8)
    assert parts["generation: idle cores"] == pytest.approx(4 * 1 / 8)
    assert result["owners"]["ours"] == pytest.approx(0.5) and result["engine_per_step"]["forwards"] == 1
    lines = step_parts.report("verl-sync", result)
    assert lines[0].startswith("verl-sync: mean step 10.000 s over 2 steps; named parts 9.500 s (95.0% of it)")
    assert lines[-1] == "  goal: the named parts within 5% of the step: met (5.0% unnamed)"


def test_fully_async_calls_to_its_rollouter_around_the_sync_are_a_part_of_their_own(tmp_path):
    # a 10 s step: waiting for samples 4 s, update 4 s, then _fit_update_weights 1.8 s, of which param_sync 0.5;
    # 0.2 s no span covers. The rollouter's reset_staleness runs 0.9 s of it.
    def step(t0):
        return [("timer/step", t0, t0 + 10, None, {}), ("timer/gen", t0, t0 + 4, None, {}),
                ("timer/update_actor", t0 + 4, t0 + 8, None, {}),
                ("fully_async_update_weights", t0 + 8, t0 + 9.8, None, {}),
                ("timer/timing_s/param_sync", t0 + 8.2, t0 + 8.7, None, {})]

    resets = [("rollouter_reset_staleness", t0 + 8.8, t0 + 9.7, None, {}) for t0 in (0, 10)]
    times = [float(t) for t in range(21)]
    write_run(tmp_path, {1: step(0) + step(10), 2: resets},
              {1: "ray::FullyAsyncTrainer", 2: "ray::FullyAsyncRollouter"}, {1: times, 2: [0.0] * 21},
              [[t, t] for t in times], times)
    result = step_parts.analyze("verl-fully-async", tmp_path, warmup=0)
    parts = result["parts"]
    assert parts[step_parts.ROLLOUTER_CALLS] == pytest.approx(1.3)
    assert parts["weight sync (this package's async_rl checkpoint engine)"] == pytest.approx(0.5)
    assert parts["rest of the step (unnamed)"] == pytest.approx(0.2)
    assert sum(parts.values()) == pytest.approx(10.0)
    assert result["engine_per_step"]["reset_staleness_s"] == pytest.approx(0.9)
    lines = step_parts.report("verl-fully-async", result)
    assert "  the rollouter's reset_staleness: 0.900 s a call in the rollouter (its wait for the rollouter's lock " \
           "included)" in lines
    assert any(line.endswith(f"verl      {step_parts.ROLLOUTER_CALLS}") for line in lines)


def test_pipeline_train_step_parts_and_the_generate_stage_busy_beside_it(tmp_path):
    times = [float(t) for t in range(9)]
    host = [("train_step", t0 + 1, t0 + 2, None, {}) for t0 in (0, 2, 4, 6)]
    host += [("pi_prox", t0 + 1, t0 + 1.25, None, {}) for t0 in (0, 2, 4, 6)]
    host += [("update_actor", t0 + 1.25, t0 + 1.75, None, {}) for t0 in (0, 2, 4, 6)]
    host += [("generate_batch", t0 + 0.5, t0 + 1.5, None, {}) for t0 in (0, 2, 4, 6)]
    host += [("generate_batch", t0 + 1, t0 + 1.5, None, {}) for t0 in (0, 2, 4, 6)]  # overlapping: counted once
    rank = [("send_weight_buckets", t0 + 1.75, t0 + 1.8, 0.05, {}) for t0 in (0, 2, 4, 6)]
    stages = [0.0 + t for t in range(9)]  # one core all along
    write_run(tmp_path, {5: host, 6: rank}, {5: "ray::StageHost", 6: "ray::PipelineWorker"}, {5: stages},
              [[float(t), float(t)] for t in range(9)], times)
    result = step_parts.analyze("pipeline-k2", tmp_path, warmup=0)
    parts = result["parts"]
    assert result["steps"] == 3 and result["step_s"] == pytest.approx(2.0)
    assert parts["waiting for the next batch"] == pytest.approx(1.0)
    assert parts["pi_prox pass (old log-probs)"] == pytest.approx(0.25) and parts["actor update"] == pytest.approx(0.5)
    assert parts["weight gather"] == pytest.approx(0.05)
    assert sum(parts.values()) == pytest.approx(2.0)
    assert sum(result["generate_busy"].values()) == pytest.approx(1.0)  # 0.5..1.5 of each step, once
    assert result["generate_busy"]["pipeline stages"] == pytest.approx(0.5)  # one of the two cores


def test_py_spy_groups_leave_blocked_stacks_out():
    path_lines = ["a (x.py:1);Worker.main_loop (ray/_private/worker.py:1069) 50",
                  "a;AgentLoopWorker._run_agent_loop (agent_loop.py:1);instantiate (hydra/_internal/instantiate/x.py:1) 3",
                  "a;x (transfer_queue/client.py:4) 1"]
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.txt"
        path.write_text("\n".join(path_lines) + "\n")
        groups = step_parts.spy_groups(path, "agent-loop worker")
    assert groups == {"building each sample's agent loop (hydra instantiate)": 0.75, "TransferQueue reads and writes": 0.25}


def test_py_spy_stacks_broken_by_a_line_break_in_a_frame_are_joined():
    text = ("a (x.py:1);task (\n ([\"llm_client_generate\", 1.0, 2.0, null, {}]\n);b (y.py:2) 4\n"
            "c (z.py:3) 1\n")
    assert step_parts.spy_lines(text) == ['a (x.py:1);task ( ([\"llm_client_generate\", 1.0, 2.0, null, {}]);b (y.py:2) 4',
                                          "c (z.py:3) 1"]


def test_arrival_gaps_are_per_server_after_warmup_and_within_a_step():
    spans = [("server_generate", t, t + 0.05, None, {}) for t in (0.5, 1.0, 1.004, 1.010, 1.110, 5.0)]
    spans.append(("engine_forward", 1.001, 1.002, None, {}))
    gaps = step_parts.arrival_gaps(spans, after=0.9)
    assert gaps == pytest.approx([0.004, 0.006, 0.1])  # 1.110 -> 5.0 is between steps
    assert step_parts.quantile(sorted(gaps), 0.5) == pytest.approx(0.006)


def test_process_kinds_from_command_lines_and_the_log(tmp_path):
    (tmp_path / "log.txt").write_text("(RewardLoopWorker pid=12) x\n(Worker pid=15) vLLM's worker logs as Worker\n")
    kinds = step_parts.process_kinds(tmp_path, {"10": "ray::AgentLoopWorkerTQ", "11": "ray::IDLE", "12": "",
                                                "13": "/usr/bin/raylet --x", "14": "ray::SomeActor.method",
                                                "15": "VLLM::Worker"})
    assert kinds == {10: "agent-loop worker", 11: "Ray's own processes", 12: "reward-loop worker",
                     13: "Ray's own processes", 14: "SomeActor.method", 15: "vLLM worker"}


def test_each_part_is_owned_by_whose_code_runs_in_it_in_a_phase_and_beside_the_step():
    for part in ("generation: vLLM worker", "actor update: vLLM engine", "vLLM server"):
        assert step_parts.owner("verl-fully-async", part) == "vLLM", part
    # the generate stage's busy time beside the pipeline's step: the same owners
    assert step_parts.owner("pipeline-k2-vllm", "vLLM worker") == "vLLM"
    assert step_parts.owner("pipeline-k2", "py-spy (this bench's profiler)") == "bench"
    assert step_parts.owner("pipeline-k2", "rollout server: engine decode forwards") == "ours"
    assert step_parts.owner("pipeline-k2", "actor update") == "ours+verl"
    assert step_parts.owner("verl-sync", "generation: agent-loop worker: tokenizing the prompt") == "verl"


def test_the_probe_records_sync_and_async_calls_once_per_wrapped_function(tmp_path, monkeypatch):
    monkeypatch.setenv(step_probe.ENV, str(tmp_path))
    monkeypatch.setattr(step_probe, "_FILE", None)

    class Engine:
        def forward(self, rows):
            return rows * 2

        async def generate(self):
            await asyncio.sleep(0.01)
            return "done"

    step_probe.wrap(Engine, "forward", "engine_forward", lambda args, kwargs: {"rows": args[1]})
    step_probe.wrap(Engine, "generate", "server_generate")
    step_probe.wrap(Engine, "forward", "again")  # wrapped once only
    step_probe.wrap(Engine, "missing", "nothing")  # a missing attribute is left alone
    engine = Engine()
    assert engine.forward(3) == 6 and asyncio.run(engine.generate()) == "done"
    step_probe._FILE.flush()
    spans = [json.loads(line) for line in next(tmp_path.glob("spans-*.jsonl")).read_text().splitlines()]
    assert [s[0] for s in spans] == ["engine_forward", "server_generate"]
    assert spans[0][4] == {"rows": 3} and spans[0][3] is not None  # a sync call: its thread's CPU
    assert spans[1][3] is None and spans[1][2] - spans[1][1] >= 0.01  # an async one: wall only


def test_the_probe_keeps_verls_auto_await_returning_the_coroutine_to_an_awaiting_caller(tmp_path, monkeypatch):
    from verl.utils.ray_utils import auto_await

    monkeypatch.setenv(step_probe.ENV, str(tmp_path))
    monkeypatch.setattr(step_probe, "_FILE", None)

    class Manager:
        @auto_await
        async def update_weights(self, step):
            await asyncio.sleep(0.01)
            return {"step": step}

    step_probe.wrap(Manager, "update_weights", "checkpoint_manager_update_weights")

    async def caller():  # as verl's fully_async trainer calls it: awaited inside a running loop
        return await Manager().update_weights(3)

    assert asyncio.run(caller()) == {"step": 3}
    assert Manager().update_weights(4) == {"step": 4}  # called without a loop: auto_await runs it
    step_probe._FILE.flush()
    spans = [json.loads(line) for line in next(tmp_path.glob("spans-*.jsonl")).read_text().splitlines()]
    assert [s[0] for s in spans] == ["checkpoint_manager_update_weights"] * 2


def test_the_probe_wraps_a_ray_actors_own_class_which_ray_pickles_for_the_actor(tmp_path, monkeypatch):
    import cloudpickle
    import ray

    monkeypatch.setenv(step_probe.ENV, str(tmp_path))
    monkeypatch.setattr(step_probe, "_FILE", None)

    class Trainer:
        async def _fit_update_weights(self):
            return "synced"

    remote = ray.remote(Trainer)
    step_probe.wrap(step_probe.actor_class(remote), "_fit_update_weights", "fully_async_update_weights")
    # what the actor's process gets: the class by value, the wrapper with it
    copy = cloudpickle.loads(cloudpickle.dumps(remote.__ray_metadata__.modified_class))
    assert asyncio.run(copy()._fit_update_weights()) == "synced"
    step_probe._FILE.flush()
    spans = [json.loads(line) for line in next(tmp_path.glob("spans-*.jsonl")).read_text().splitlines()]
    assert [s[0] for s in spans] == ["fully_async_update_weights"]


def test_the_long_task_needs_a_model_that_holds_its_responses_and_runs_with_its_overrides(tmp_path, monkeypatch):
    """`--task long` is refused with the tiny model (256-token responses past its positions); with the small one
    a run gets the long task's overrides and the system's, as bench/e2e.py's runs do."""
    with pytest.raises(SystemExit):
        step_parts.main(["--task", "long", "--model-size", "tiny", "--systems", "verl-sync"])
    with pytest.raises(SystemExit):
        step_parts.main(["--model-size", "huge"])

    popen = step_parts.subprocess.Popen

    def no_run(cmd, *args, **kwargs):  # verl's command is not started; git and the like are
        if step_parts.e2e.VERL_MAIN in cmd:
            raise RuntimeError("stop before running")
        return popen(cmd, *args, **kwargs)

    monkeypatch.setattr(step_parts.subprocess, "Popen", no_run)  # run_system has written the run's overrides
    with pytest.raises(RuntimeError, match="stop before running"):
        step_parts.main(["--task", "long", "--model-size", "small", "--systems", "pipeline-k2-train2", "--steps", "3",
                         "--raw-dir", str(tmp_path), "--py-spy", ""])
    overrides = dict(o.split("=", 1) for o in json.loads((tmp_path / "long_pipeline-k2-train2" / "overrides.json")
                                                         .read_text()))
    assert overrides["trainer.experiment_name"] == "long_tail" and overrides["data.max_response_length"] == "256"
    assert overrides["+trainer.generate_ahead_steps"] == "2" and overrides["trainer.total_training_steps"] == "3"
    assert overrides["+trainer.use_nodes_ratios"] == str(step_parts.e2e.train_split(2)["+trainer.use_nodes_ratios"])
    assert json.loads((tmp_path / "demo" / "model" / "config.json").read_text())["hidden_size"] == 256  # small
