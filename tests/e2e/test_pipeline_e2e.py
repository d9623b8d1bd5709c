"""End to end: the plain verl command with `+actor_rollout_ref.async_pipeline=True` on the tiny demo."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from helpers.rows import every_step_with, step_rows, val_rows
from helpers.runs import run_verl

STAGES = ("dataloader", "generate", "rollout", "reward", "logp", "ref_logp", "actor_train", "param_update")
REQUIRED_STEP_KEYS = (
    "critic/score/mean",
    "timing_s/step",
    "async/param_version",
    "async/staleness/max",
    "async/staleness/mean",
    *(f"async/{s}/busy_ratio" for s in STAGES),
)


def _short_run(k: int, steps: int) -> dict:
    return {
        "trainer.total_training_steps": steps,
        "trainer.test_freq": 2,
        "+trainer.generate_ahead_steps": k,
    }


# naive PPO, with verl's KL penalty in the reward (which brings the ref_logp stage in); this run also has
# each stage in a process of its own (the default hosts a node's stages in one)
NAIVE_PPO_KL = {"+algorithm.decoupled_ppo": False, "algorithm.rollout_correction.bypass_mode": True,
                "algorithm.use_kl_in_reward": True, "+trainer.stage_processes": "per_stage"}
STAGES = "dataloader, generate, rollout, reward, logp, ref_logp, param_update, actor_train"
KL_LOSS = {"actor_rollout_ref.actor.use_kl_loss": True}  # verl's KL loss against the ref_logp stage's log-probs
# ReMax (verl 0.9.1's own trainer fails at step 1: no baseline)
REMAX = {"algorithm.adv_estimator": "remax"}
# pi_prox by AReaL's log-linear approximation inside the loss: no pi_prox forward
LOGLINEAR = {"+algorithm.proximal_logp_method": "loglinear"}
# pi_prox the update's own forward (the demo's actor takes one optimizer step a training step): no pi_prox forward
UPDATE_FORWARD = {"+algorithm.proximal_logp_method": "update_forward"}
# verl's DAPO dynamic sampling key: training batches of groups whose rewards differ (a dynamic_sampling stage)
DYNAMIC_SAMPLING = {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.max_num_gen_batches": 10}
def profiled(save_path) -> dict:
    """verl's torch profiler over steps 2 and 3 (one window: profile_continuous_steps) on the actor and ref ranks."""
    return {"global_profiler.tool": "torch", "global_profiler.steps": [2, 3], "global_profiler.save_path": str(save_path),
            "global_profiler.profile_continuous_steps": True, "actor_rollout_ref.actor.profiler.enable": True,
            "actor_rollout_ref.actor.profiler.all_ranks": True, "actor_rollout_ref.ref.profiler.enable": True,
            "actor_rollout_ref.ref.profiler.all_ranks": True}


def trace_name(path) -> tuple[str, str]:
    """(what verl's trace file name says before its rank, the rank part) of a trace."""
    head, _, rest = path.name.partition("_rank")
    return head, rest.split("_pid")[0]


# verl's examples/rollout_correction/run_with_rollout_corr.sh, in verl 0.9.1's keys and on the demo's model,
# data and sizes: RLOO, gamma 1, bypass mode (pi_old = the rollout's log-probs) with verl's bypass-mode loss,
# REINFORCE weighted by self-normalised sequence-level IS with threshold 2, on the train ranks
ROLLOUT_CORRECTION_EXAMPLE = {
    "algorithm.adv_estimator": "rloo", "algorithm.gamma": 1.0,
    "algorithm.rollout_correction.rollout_is": "sequence", "algorithm.rollout_correction.rollout_is_threshold": 2.0,
    "algorithm.rollout_correction.rollout_is_batch_normalize": True,
    "algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.loss_type": "reinforce",
    "actor_rollout_ref.rollout.calculate_log_probs": True,
}


# Each run also carries settings that do not touch the staleness bound, so that one run shows both: k1 the
# user's own rollout correction with dynamic sampling, k3-kl-loss ReMax (not with dynamic sampling, whose
# training batches carry the dynamic_sampling stage's metrics instead of the reward stage's), Ray's timeline and
# verl's torch profiler.
@pytest.mark.parametrize("k,steps,extra", [(1, 4, {**ROLLOUT_CORRECTION_EXAMPLE, **DYNAMIC_SAMPLING}),
                                           (3, 6, {**KL_LOSS, **REMAX}), (3, 4, NAIVE_PPO_KL), (2, 4, LOGLINEAR),
                                           (2, 3, UPDATE_FORWARD)],
                         ids=["k1-own-rollout-correction-dynamic-sampling", "k3-kl-loss-remax", "k3-naive-kl",
                              "k2-loglinear-proximal", "k2-update-forward-proximal"])
def test_pipeline_trains_with_bounded_staleness(demo_dir, tmp_path, ray_address, k, steps, extra):
    """Every step trains on samples at most k - 1 versions old (k = 1: on-policy), pi_prox the pre-update
    version under decoupled PPO (interpolated in the loss, with no forward, under
    `+algorithm.proximal_logp_method=loglinear`; the update's own forward under `update_forward`), the behaviour
    policy under naive PPO; and, in the same runs:
    `algorithm.filter_groups.enable=True` fills every training batch with groups whose rewards differ, drawn
    from as many generated batches as it takes; the user's own `algorithm.rollout_correction` trains as set
    (verl's bypass-mode loss, its IS weights from the train ranks' policy against the rollout's log-probs);
    `algorithm.adv_estimator=remax` trains against one greedy sample per prompt, generated and scored beside
    the n sampled ones, never trained on, each sample's advantage its score less its prompt's greedy score
    (the copy task scores in [0, 1])."""
    from async_rl.demo.task import GROUP_SIZE, TRAIN_BATCH_SIZE

    remax = REMAX.items() <= extra.items()
    timeline = tmp_path / "timeline.json"  # verl's ray_kwargs.timeline_json_file, in one of the runs
    profiles = tmp_path / "profile"  # and verl's torch profiler of steps 2-3 in one window, train and ref ranks
    extra = {**extra, "ray_kwargs.timeline_json_file": str(timeline), **profiled(profiles)} if remax else extra
    code, out, rows = run_verl(demo_dir, {**_short_run(k, steps), **extra}, tmp_path, ray_address=ray_address)
    naive = extra is NAIVE_PPO_KL
    kl_loss = KL_LOSS.items() <= extra.items()
    dynamic = DYNAMIC_SAMPLING.items() <= extra.items()
    own_correction = ROLLOUT_CORRECTION_EXAMPLE.items() <= extra.items()
    loglinear = extra is LOGLINEAR
    update_forward = extra is UPDATE_FORWARD
    assert code == 0, out[-4000:]
    stages = STAGES.replace("reward, ", "reward, dynamic_sampling, ") if dynamic else STAGES
    processes = f"8 (per_stage): {stages}" if naive else f"1 (per_node): {stages.replace(', ', '+')} on node"
    assert f"stage processes: {processes}" in out
    if own_correction:
        assert "verl's rollout correction as set, not AReaL's decoupled PPO" in out
        assert "the actor's loss is verl's bypass-mode loss" in out
    required = (*REQUIRED_STEP_KEYS, *(["async/remax/baseline_score/mean"] if remax else []),
                # verl's bypass-mode loss logs the normalising factor (only with rollout_is_batch_normalize=True,
                # which decoupled PPO leaves off) from the train ranks
                *(["actor/rollout_corr/rollout_is_batch_norm_factor"] if own_correction else []))
    by_step = every_step_with(rows, steps, required)
    for step, metrics in by_step.items():
        assert metrics["async/param_version"] == step
        assert 0.0 <= metrics["critic/score/mean"] <= 1.0
        assert metrics["async/staleness/max"] <= k - 1
        hist = [metrics.get(f"async/staleness/hist_{s}", 0.0) for s in range(k)]
        assert abs(sum(hist) - 1.0) < 1e-6, hist  # every sample in a bucket 0..eta
        assert 1 <= metrics["async/partial/max_versions_spanned"] <= k  # a sample spans at most eta + 1 versions
        assert ("actor/kl_loss" in metrics) == kl_loss
        if naive or own_correction:  # bypass mode: pi_old is the behaviour policy; nothing recomputed
            assert metrics["async/logp_version"] == -1 and "rollout_corr/rollout_is_mean" not in metrics
            assert "timing_s/old_log_prob" not in metrics
        if naive:  # naive PPO: no weights
            # KL(pi_behav || pi_ref) in the reward (the ref_logp stage ran), verl's default fixed coefficient
            assert metrics["actor/reward_kl_penalty_coeff"] == 0.001
            assert abs(metrics["actor/reward_kl_penalty"]) < 10
            assert not any(key.startswith("actor/rollout_corr/") for key in metrics)
        elif loglinear:  # pi_prox interpolated in the loss, per token: no forward, its weights from verl's helper there
            assert metrics["async/logp_version"] == -1 and "timing_s/old_log_prob" not in metrics
            assert 0.0 <= metrics["actor/proximal_interpolation"] < 1.0
            assert "actor/rollout_corr/rollout_is_mean" in metrics and "rollout_corr/rollout_is_mean" not in metrics
        elif update_forward:  # pi_prox the update's forward: u = pi_theta / pi_prox is 1, PPO's clip never binds
            assert metrics["async/logp_version"] == -1 and "timing_s/old_log_prob" not in metrics
            assert "actor/proximal_interpolation" not in metrics and metrics["actor/pg_clipfrac"] == 0.0
            assert "actor/rollout_corr/rollout_is_mean" in metrics and "rollout_corr/rollout_is_mean" not in metrics
        elif not own_correction:  # decoupled PPO: pi_prox is the trainer's pre-update version, token weights from verl
            assert "actor/reward_kl_penalty" not in metrics
            assert metrics["async/logp_version"] == step - 1
            assert "rollout_corr/rollout_is_mean" in metrics
            assert metrics["timing_s/old_log_prob"] > 0  # computed on the train ranks (the default)
        if dynamic:  # every training batch full of groups whose rewards differ
            assert metrics["async/dynamic_sampling/gen_batches"] >= 1
            assert metrics["async/trained_rows"] == TRAIN_BATCH_SIZE * GROUP_SIZE  # full, not filtered down
            assert metrics["async/staleness/max"] <= 1
            assert "async/dynamic_sampling/busy_ratio" in metrics
        if own_correction:  # the sequence weights, truncated at 2, normalised in the loss on the train ranks
            assert 0 < metrics["actor/rollout_corr/rollout_is_batch_norm_factor"] <= 2.0, (step, metrics)
        if remax:
            assert 0.0 <= metrics["async/remax/baseline_score/mean"] <= 1.0
            assert metrics["async/trained_rows"] == TRAIN_BATCH_SIZE * GROUP_SIZE  # the greedy samples are not trained
            assert -1.0 <= metrics["critic/advantages/min"] <= metrics["critic/advantages/max"] <= 1.0, metrics
    if k == 1:
        assert all(m["async/staleness/max"] == 0 for m in by_step.values())
        # on-policy: the train ranks' policy (FSDP2) before the update, in verl's bypass-mode loss (one mini-batch a
        # step), is the policy that sampled (CPU backend); after the update every step's log-perplexities would
        # differ by ~1e-2
        assert all(m["actor/rollout_corr/log_ppl_abs_diff"] < 1e-4 for m in by_step.values()), by_step
    else:  # generation really ran ahead: some step trained on data older than the trainer
        assert max(m["async/staleness/max"] for m in by_step.values()) >= 1
    if loglinear:  # tokens one version old sit halfway between pi_behav and the current policy
        assert max(m["actor/proximal_interpolation"] for m in by_step.values()) > 0
    if remax:  # Ray's timeline of the run's tasks, written once it trained, as verl's run_ppo writes it
        events = json.loads(timeline.read_text())
        assert isinstance(events, list) and any(e.get("cat") == "task" or "name" in e for e in events)
        # verl's traces: one per rank of the train and ref groups, named by verl for the window's first step
        traces = {trace_name(path): path for path in profiles.iterdir()}
        assert {name for name, _ in traces} == {"actor_train_step2", "ref_step2"}, sorted(traces)
        for path in traces.values():
            with gzip.open(path, "rt") as f:
                assert any(e.get("name") for e in json.load(f)["traceEvents"]), path
    vals = val_rows(rows)
    assert 0 in vals and steps in vals, sorted(vals)
    assert "val-core/async_rl/copy_digits/reward/mean@1" in vals[steps]


def test_val_only_validates_and_trains_nothing(demo_dir, tmp_path, ray_address):
    extra = {"trainer.val_only": True, "trainer.val_before_train": True}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=300, ray_address=ray_address)  # training would take longer
    assert code == 0, out[-4000:]
    assert sorted(val_rows(rows)) == [0] and not step_rows(rows)


def test_bad_config_value_fails_before_ray(demo_dir, tmp_path):
    code, out, _ = run_verl(demo_dir, ["+trainer.use_nodes_ratios=[0.5,0.5,1.5]"], tmp_path, timeout_s=120)
    assert code != 0
    assert "trainer.use_nodes_ratios=[0.5, 0.5, 1.5]" in out
    assert "allowed" in out
    assert "Started a local Ray instance" not in out


def test_a_key_no_one_reads_is_refused_before_ray_with_the_flag_typed_as_1(demo_dir, tmp_path):
    """`=1` reaches the plugin as the int 1: the pipeline's checks run (verl's trainer would have run without a
    word), and an added key neither verl nor the pipeline reads is refused naming the key meant."""
    start = time.monotonic()
    code, out, _ = run_verl(demo_dir, {"+actor_rollout_ref.async_pipeline": 1, "+trainer.generate_ahead": 3}, tmp_path,
                            timeout_s=120)
    assert code != 0
    assert "trainer.generate_ahead=3" in out and "nearest: trainer.generate_ahead_steps" in out, out[-3000:]
    assert "Started a local Ray instance" not in out
    print(f"refused in {time.monotonic() - start:.1f} s")


def test_an_estimator_the_pipeline_cannot_run_is_refused_before_ray(demo_dir, tmp_path):
    code, out, _ = run_verl(demo_dir, {"algorithm.adv_estimator": "optimal_token_baseline"}, tmp_path, timeout_s=120)
    assert code != 0
    assert "algorithm.adv_estimator='optimal_token_baseline'" in out and "sum_pi_squared" in out
    assert "Started a local Ray instance" not in out


def test_more_workers_than_ray_can_place_fails_at_once(demo_dir, tmp_path):
    """Checked before any pool is placed (not by waiting out the 300 s placement timeout)."""
    code, out, _ = run_verl(demo_dir, {"trainer.n_gpus_per_node": 64}, tmp_path, timeout_s=240)
    assert code != 0
    # train 32 + generate 32 (no logp group: pi_prox on the train ranks; no ref: no KL), one node
    assert "trainer.nnodes=1 needs 1 Ray nodes with CPU 64 each" in out and "CPU 16" in out
    assert "ray_kwargs.ray_init.num_cpus" in out
    assert "Started a local Ray instance" in out  # it did get past the config checks
    leftover = ray_processes_after(20.0, tmp_path)
    assert not leftover, f"Ray processes left behind: {leftover}"


def ray_processes_after(grace_s: float, run_dir: Path) -> list[str]:
    """`ray::` processes of the run started in ``run_dir`` (their working directory: Ray's processes
    inherit the driver's; other runs on the machine have theirs) still alive `grace_s` seconds from
    now at the latest (exiting ones get that long)."""
    def ours() -> list[str]:
        found = []
        for line in subprocess.run(["pgrep", "-af", "ray::"], capture_output=True, text=True).stdout.splitlines():
            try:
                cwd = Path(os.readlink(f"/proc/{line.split()[0]}/cwd"))
            except OSError:
                continue  # exited meanwhile
            if cwd == run_dir or run_dir in cwd.parents:
                found.append(line)
        return found

    deadline = time.monotonic() + grace_s
    while True:
        out = ours()
        if not out or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


def test_failing_reward_stops_the_run_with_the_stage_named(demo_dir, tmp_path):
    bad_reward = tmp_path / "bad_reward.py"
    bad_reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
        "    raise ValueError('reward exploded')\n"
    )
    extra = {**_short_run(2, 4), "reward.custom_reward_function.path": str(bad_reward), "trainer.val_before_train": False}
    code, out, rows = run_verl(demo_dir, extra, tmp_path, timeout_s=300)
    assert code != 0
    assert "stage 'reward' failed" in out
    assert "reward exploded" in out
    assert not step_rows(rows)  # no step trained on missing rewards
    leftover = ray_processes_after(20.0, tmp_path)
    assert not leftover, f"Ray processes left behind: {leftover}"
