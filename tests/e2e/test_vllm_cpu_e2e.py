"""verl's own vLLM rollout on vLLM's CPU build (the vllm venv; scripts/test.sh runs these there).

Under the flag and in verl's own async trainer, `fully_async_policy` (its weights sent by the `async_rl`
checkpoint-engine backend), through verl's `vLLMReplica` / `vLLMHttpServer`. With `rollout.dtype=float32`
the log-probs vLLM returns equal the trainer's recomputed ones within fp32 noise at every step, which
holds only if every new version reached vLLM (one step of training moves them by ~1e-3). A reward model
served by vLLM scores what the pipeline trains, and a lost reward-model server is started again at a new
address, verl's router following it."""

from __future__ import annotations

import contextlib
import signal
import urllib.request

import pytest
import yaml

from async_rl.rollout.vllm_digests import ALLOW_PICKLE_ENV
from helpers.lineage import dumped_step_inputs, expected_step_inputs, read_jsonl
from helpers.processes import assert_nothing_left, kill_session, wait_until
from helpers.rows import every_step_with, step_rows, val_rows
from helpers.runs import read_digests, run_verl, start_pipeline_reading_digests, start_verl

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
from bench import e2e, faults

VLLM_ON_CPU = e2e.VLLM_ON_CPU  # fp32, the trainer's dtype: log-probs comparable to fp32 noise
FP32_NOISE = 1e-5  # measured: 7e-8 to 8e-8 (bf16 rollout: 4e-4)


@contextlib.contextmanager
def run_to_its_end(proc, timeout_s: float = 900):
    """After the block, waits up to `timeout_s` for the run to end; kills its session if it still runs
    (the block or the wait failed)."""
    try:
        yield
        proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            kill_session(proc)


def scrape_targets(prometheus_file) -> list[str]:
    """The `rollout` job's targets in the Prometheus config verl's update_prometheus_config wrote."""
    jobs = yaml.safe_load(prometheus_file.read_text())["scrape_configs"]
    return [target for job in jobs if job["job_name"] == "rollout" for config in job["static_configs"]
            for target in config["targets"]]


def ended_cleanly(proc, log_path, what: str) -> str:
    """The run exited 0 and left nothing of it (vLLM's engine processes included); returns its log."""
    log = log_path.read_text()
    assert proc.returncode == 0, log[-4000:]
    assert_nothing_left(proc, f"after the run's end ({what})")
    return log


PIPELINE = {
    **VLLM_ON_CPU,
    "trainer.val_before_train": False,
    "trainer.save_freq": -1,
}


def test_pipeline_on_vllm_serves_each_version_of_a_lora_adapter(demo_dir, tmp_path, ray_address):
    """LoRA (the demo's `overrides_lora.txt` keys) on vLLM: the servers load the frozen base from the
    model's path, every version carries the adapter alone and vLLM serves it through its LoRA support
    (verl's `add_lora` path). k=1: vLLM's log-probs equal the trainer's within fp32 noise at every step,
    which holds only if each trained adapter reached vLLM (a step moves them by about 1e-2)."""
    from safetensors.torch import load_file

    from async_rl.demo.task import LORA_OVERRIDES

    extra = {**PIPELINE, **LORA_OVERRIDES, "+trainer.generate_ahead_steps": 1, "trainer.total_training_steps": 3,
             "trainer.test_freq": 3}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    assert "LoRA on vLLM: actor_rollout_ref.rollout.load_format=auto" in out
    by_step = every_step_with(rows, 3, ["rollout_corr/log_ppl_abs_diff", "async/param_update/bytes"])
    base = load_file(str(demo_dir / "model" / "model.safetensors"))
    rank = int(LORA_OVERRIDES["actor_rollout_ref.model.lora_rank"])
    linear = [t for name, t in base.items() if t.dim() == 2 and "embed" not in name and "lm_head" not in name]
    adapter_bytes = sum(rank * sum(t.shape) * 4 for t in linear)  # A: r x in, B: out x r, float32
    for step, metrics in by_step.items():
        assert metrics["async/staleness/max"] == 0, step
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, metrics["rollout_corr/log_ppl_abs_diff"])
        assert metrics["async/param_update/bytes"] == adapter_bytes, step  # the adapter, not the model
    assert 3 in val_rows(rows)  # validation through vLLM with the adapter


RESTART_GUARD_S = 480  # reward.async_timeout_s: a hang guard; on 2 cores under the test lanes' load a vLLM
# reward-model restart takes about 220 s (vLLM's imports and engine start, then verl's router started again). verl's
# client gives a row 16 tries, about 330 s of backoff in all.


def listening_ports(process) -> set[int]:
    """The TCP ports `process` (a psutil.Process) listens on (none once it is gone)."""
    import psutil

    try:
        return {c.laddr.port for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


def router_processes(driver_pid: int) -> list:
    """verl's reward-model router: a process the driver spawns (the pipeline runs there), so a child with
    spawn's command line (`--multiprocessing-fork`) that listens."""
    import psutil

    driver = psutil.Process(driver_pid)
    found = []
    for child in driver.children():
        try:
            cmdline = child.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "--multiprocessing-fork" in cmdline and listening_ports(child):
            found.append(child)
    return found


def test_pipeline_scores_with_a_reward_model_served_by_vllm_a_killed_server_too(demo_dir, tmp_path, monkeypatch):
    """`reward.reward_model.rollout.name=vllm` (verl's keys, fp32) on a device of its own
    (`enable_resource_pool`, 1 x 1), the policy on the CPU backend: the reward stage and validation
    score through verl's reward loop and vLLM's /classify; every dumped score is the reward model's
    forward, recomputed here by hand. The reward model's vLLM server is SIGKILLed with
    `rollout.max_restarts=1` once validation at step 0 is logged, as training starts: it starts again at a
    new address, verl's router starts again on its own address with it, rows sent meanwhile are retried by
    verl's client within `reward.async_timeout_s`, and the run ends with no reward error and nothing of it
    left. (One run for both: a vLLM start costs about 2.5 core-minutes on 2 cores.)"""
    from test_reward_model_e2e import plain_response_text, reward_model_keys, scored_by_hand

    dump, val_dump = tmp_path / "dump", tmp_path / "val_dump"
    extra = {**reward_model_keys(demo_dir, dump, None), "reward.reward_model.rollout.name": "vllm",
             "reward.reward_model.rollout.dtype": "float32", "reward.reward_model.rollout.enforce_eager": True,
             "reward.reward_model.enable_resource_pool": True, "reward.reward_model.n_gpus_per_node": 1,
             "reward.reward_model.nnodes": 1,
             "+actor_rollout_ref.rollout.max_restarts": 1,  # the reward model's replicas' limit too
             "+reward.async_timeout_s": RESTART_GUARD_S, "trainer.validation_data_dir": str(val_dump)}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # a Ray of its own: every process of the run in its session
    metrics, log_path = tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.log"
    proc = start_verl(demo_dir, extra, tmp_path)
    with run_to_its_end(proc):
        # the stages start once validation at step 0 is logged: every training row is scored after the kill
        wait_until(lambda: val_rows(read_jsonl(metrics)), proc, "validation at step 0", timeout_s=600)
        # the policy is on the CPU backend: the run's one vLLM server is the reward model's
        servers = faults.titled_processes(proc.pid, "ray::vLLMHttpServer")
        assert len(servers) == 1, [s.cmdline() for s in servers]
        routers = router_processes(proc.pid)
        assert len(routers) == 1, [r.cmdline() for r in routers]
        killed, old_ports = servers[0].pid, listening_ports(servers[0])
        router, router_ports = routers[0].pid, listening_ports(routers[0])
        assert old_ports and router_ports, (old_ports, router_ports)
        trained_before = step_rows(read_jsonl(metrics))
        servers[0].send_signal(signal.SIGKILL)
        # verl's router is started again once the new server is up: on the old router's address
        wait_until(lambda: [r for r in router_processes(proc.pid) if r.pid != router
                            and listening_ports(r) == router_ports],
                   proc, "verl's router started again on its address", timeout_s=RESTART_GUARD_S)
        new = [s for s in faults.titled_processes(proc.pid, "ray::vLLMHttpServer") if s.pid != killed]
        assert len(new) == 1, [s.cmdline() for s in new]
        new_ports = listening_ports(new[0])
        assert new_ports and new_ports.isdisjoint(old_ports), (old_ports, new_ports)  # a new address
    log = ended_cleanly(proc, log_path, "the reward model's vLLM server killed and restarted")  # verl's router too
    assert "reward model replica 0 lost: restart 1 of 1" in log
    assert "did not start again" not in log
    # rows sent during the restart (it takes vLLM's start, tens of seconds; step 1's come within seconds of
    # the kill): the old router, its one server gone, failed them; verl's client sent them again until the
    # new router answered (no reward error below)
    assert "Failed to complete async request to classify" in log
    rows = read_jsonl(metrics)
    steps = every_step_with(rows, 2, ["critic/score/mean", "async/faults/reward_errors",
                                      "async/faults/replica_restarts"])
    assert trained_before == {}
    assert all(metrics["async/faults/reward_errors"] == 0 for metrics in steps.values())
    # the policy's replica was not restarted: the server killed was the reward model's
    assert all(metrics["async/faults/replica_restarts"] == 0 for metrics in steps.values())
    assert sorted(val_rows(rows)) == [0, 2]
    pairs = scored_by_hand(demo_dir, dump, plain_response_text)
    assert len(pairs) >= 64, len(pairs)
    assert len({round(d, 6) for d, _ in pairs}) > 10  # the model's scores, not a constant
    for dumped, by_hand in pairs:
        assert dumped == pytest.approx(by_hand, abs=1e-4)
    # validation's scores too, step 2's from the restarted server
    assert sorted(path.name for path in val_dump.glob("*.jsonl")) == ["0.jsonl", "2.jsonl"]
    val_pairs = scored_by_hand(demo_dir, val_dump, plain_response_text)
    assert val_pairs, "no validation row to recompute"
    for dumped, by_hand in val_pairs:
        assert dumped == pytest.approx(by_hand, abs=1e-4)


def test_pipeline_on_vllm_runs_ahead_within_the_bound_and_loads_during_generation(demo_dir, tmp_path, ray_address):
    """k=3: generation runs up to 2 versions ahead, never more; weights load into vLLM between
    decoding steps (verl's abort + the generate stage's resubmission of prompt + tokens so far), so
    some responses carry tokens of two versions."""
    k, steps = 3, 5
    # generation the bottleneck, so every load lands while vLLM decodes: 256 responses of 32 tokens,
    # 8 at a time (a batch takes several times a training step)
    slow_generation = {"data.max_response_length": 32, "actor_rollout_ref.rollout.ignore_eos": True,
                       "actor_rollout_ref.rollout.max_num_seqs": 8}
    extra = {**PIPELINE, **slow_generation, "+trainer.generate_ahead_steps": k,
             "trainer.total_training_steps": steps, "trainer.test_freq": steps}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, ["async/staleness/max", "async/partial/max_versions_spanned",
                                            "async/param_update/blocked_s"])
    for step, metrics in by_step.items():
        assert metrics["async/staleness/max"] <= k - 1, step
        assert 1 <= metrics["async/partial/max_versions_spanned"] <= k, step
    assert max(m["async/staleness/max"] for m in by_step.values()) >= 1  # it really ran ahead
    assert max(m["async/partial/max_versions_spanned"] for m in by_step.values()) >= 2  # loaded mid-response
    assert steps in val_rows(rows)


def test_pipeline_on_vllm_without_partial_rollout_waits_for_running_requests(demo_dir, tmp_path, ray_address):
    """partial_rollout=False: a load parks new requests and waits for the running ones, so no response
    spans two versions, while generation still runs ahead within the bound."""
    k, steps = 3, 3
    extra = {**PIPELINE, "+trainer.generate_ahead_steps": k, "trainer.total_training_steps": steps,
             "trainer.test_freq": -1, "+actor_rollout_ref.rollout.partial_rollout": False}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=900, ray_address=ray_address)
    assert code == 0, out[-4000:]
    by_step = every_step_with(rows, steps, ["async/staleness/max", "async/partial/max_versions_spanned"])
    for step, metrics in by_step.items():
        assert metrics["async/partial/max_versions_spanned"] == 1, step
        assert metrics["async/staleness/max"] <= k - 1, step


def test_pipeline_on_vllm_on_policy_every_version_reaches_vllm_a_killed_server_too(demo_dir, tmp_path):
    """k=1: each step trains on responses of the newest version, and vLLM's log-probs equal the trainer's
    within fp32 noise at every step: every version reached vLLM (through the `async_rl` checkpoint-engine
    backend), version 0 included (verl's servers start on dummy weights). verl's vLLM replica is SIGKILLed
    mid-run with `rollout.max_restarts=1`: its workers and server start again on the same devices, load the
    newest version before serving, and the run ends with every step trained once on the prompts an unfaulted
    run trains. After training, the weights the restarted vLLM computes with are the trainer's, bit for bit.
    With `rollout.prometheus.enable`, Prometheus's config names the server as its scrape target, its
    /metrics answering there, and is written again for the restarted server. Versions after the first go as
    deltas (`param_update_delta_sync`): vLLM's replica puts them together over the version it loaded last, and
    the restarted one loads the whole version kept for restarts.
    (One run for all four: a vLLM run's start costs about 2.5 core-minutes on 2 cores.)"""
    steps = 6
    dumps, prometheus = tmp_path / "dumps", tmp_path / "prometheus" / "prometheus.yml"
    extra = {**PIPELINE, "+trainer.generate_ahead_steps": 1, "trainer.total_training_steps": steps,
             "trainer.test_freq": steps, "trainer.rollout_data_dir": str(dumps),
             "+actor_rollout_ref.rollout.max_restarts": 1,
             "+actor_rollout_ref.rollout.param_update_delta_sync": True,
             "actor_rollout_ref.rollout.prometheus.enable": True,
             "actor_rollout_ref.rollout.prometheus.file": str(prometheus),
             f"+ray_kwargs.ray_init.runtime_env.env_vars.{ALLOW_PICKLE_ENV}": "1"}  # in the servers' environment
    metrics, log_path = tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl.log"
    proc = start_pipeline_reading_digests(demo_dir, extra, tmp_path)
    with run_to_its_end(proc):
        wait_until(lambda: len(step_rows(read_jsonl(metrics))) >= 2, proc, "step 2", timeout_s=600)
        targets = scrape_targets(prometheus)
        assert len(targets) == 1, targets
        with urllib.request.urlopen(f"http://{targets[0]}/metrics", timeout=30) as answer:
            assert b"# TYPE http_request" in answer.read()  # the server's Prometheus metrics, to be scraped there
        servers = faults.titled_processes(proc.pid, "ray::vLLMHttpServer")
        assert len(servers) == 1, [s.cmdline() for s in servers]
        killed = servers[0].pid
        written = prometheus.stat().st_mtime_ns
        servers[0].send_signal(signal.SIGKILL)
        killed_after = max(step_rows(read_jsonl(metrics)))
        wait_until(lambda: [s for s in faults.titled_processes(proc.pid, "ray::vLLMHttpServer") if s.pid != killed],
                   proc, "a new vLLM server process", timeout_s=600)
    log = ended_cleanly(proc, log_path, "a vLLM server killed and restarted")
    assert prometheus.stat().st_mtime_ns > written and len(scrape_targets(prometheus)) == 1  # the new server's
    rows = read_jsonl(metrics)
    by_step = every_step_with(rows, steps, ["rollout_corr/log_ppl_abs_diff", "async/staleness/max",
                                            "async/faults/replica_restarts", "async/param_update/delta"])
    assert killed_after < steps
    assert by_step[steps]["async/faults/replica_restarts"] == 1.0
    assert by_step[1]["async/faults/replica_restarts"] == 0.0
    # step v + 1's row holds version v's sync (1 to 5, each a delta); step 1's holds version 0's (whole, the first)
    # or version 1's, as the sync's end and the row's fall
    assert [m["async/param_update/delta"] for m in by_step.values()][1:] == [1.0] * (steps - 1)
    # the supervisor's warnings reach the log (LOG_LEVEL: vLLM's server import would silence them)
    assert "lost (ActorDiedError" in log and "back (restart 1)" in log
    for step, m in by_step.items():  # the restarted server served the trainer's newest weights, not dummy ones
        assert m["async/staleness/max"] == 0, step
        assert m["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE, (step, m["rollout_corr/log_ppl_abs_diff"])
    assert steps in val_rows(rows)  # validation through vLLM
    assert dumped_step_inputs(dumps) == expected_step_inputs(demo_dir, steps)
    digests = read_digests(tmp_path)["digests"]
    assert set(digests) == {"actor_train", "rollout_replica_0"}
    trainer, served = digests["actor_train"], digests["rollout_replica_0"]
    assert any(".q_proj." in name for name in served)  # vLLM's fused qkv_proj, split back to the trainer's names
    # every tensor vLLM serves is the trainer's; the trainer's lm_head is the tied embedding vLLM holds once
    assert served == {name: d for name, d in trainer.items() if name != "lm_head.weight"}
    assert trainer.get("lm_head.weight", trainer["model.embed_tokens.weight"]) == trainer["model.embed_tokens.weight"]


def test_verls_fully_async_policy_runs_on_cpu_with_the_async_rl_checkpoint_engine(demo_dir, tmp_path):
    """verl's own async trainer (`fully_async_policy`, as bench/e2e.py runs it) on vLLM's CPU build, its
    weights sent by the `async_rl` checkpoint-engine backend. With nothing generated ahead
    (`staleness_threshold=0`) and pi_old recomputed by the trainer, the log-probs vLLM returned equal
    the trainer's within fp32 noise at every logged step: every version reached vLLM."""
    extra = {**VLLM_ON_CPU, **e2e.fully_async_overrides(steps=3, prompts_per_step=32),
             "async_training.staleness_threshold": 0, "algorithm.rollout_correction.bypass_mode": False,
             "trainer.val_before_train": False, "trainer.test_freq": 2, "trainer.save_freq": -1}
    rows = e2e.run_system("verl-fully-async", demo_dir, tmp_path, tmp_path / "metrics.jsonl", extra, timeout_s=600,
                          main=e2e.FULLY_ASYNC_MAIN)
    assert "Checkpoint manager initialized (backend=async_rl)" in (tmp_path / "metrics.log").read_text()
    trained = [r["data"] for r in rows if "training/rollout_probs_diff_max" in r["data"]]
    assert len(trained) >= 2 and {m["training/global_step"] for m in trained} >= {1.0, 2.0}
    for metrics in trained:
        assert metrics["training/rollout_probs_diff_max"] < FP32_NOISE, metrics["training/global_step"]
        assert metrics["rollout_corr/log_ppl_abs_diff"] < FP32_NOISE
    assert val_rows(rows) or any(k.startswith("val-aux/") for r in rows for k in r["data"])  # validation ran
