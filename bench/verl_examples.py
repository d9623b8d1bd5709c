"""Benchmark: verl's example scripts with the flag and without it (verl's own trainer), on the demo.

Each example's verl keys (`EXAMPLES`: what its script at verl's commit b178a3cd5, verl 0.9.1, sets that
changes training or what is logged, in the script's own key names, legacy ones included) run 2 steps on
the demo's model and data (8 prompts a step, `DEMO_SIZES`; a script that logs validation generations
validates at the last step, a script with a critic or a reward model gets the demo's, `{demo}` in a
value being the demo's folder; a script that sets no group size gets the demo's, 8), once with `+actor_rollout_ref.async_pipeline=True` and once flag off,
one run at a time, each with a Ray of its own. Per run: trained or failed (the error's last line),
seconds, and step 2's `actor/pg_loss` and `critic/advantages/mean`. The flag-on half is also a test
(tests/e2e/test_verl_examples_e2e.py); the flag-off half is verl's own trainer as a control, run here
rather than in CI (about 7 minutes on 2 cores).

    python bench/verl_examples.py [--examples rloo_trainer/run_qwen2-7b.sh,...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import command_line  # noqa: E402
from bench.e2e import run_system  # noqa: E402

ACTOR, ROLLOUT, CORR = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "algorithm.rollout_correction"


def OVERLONG(enable: bool) -> dict:  # noqa: N802 - the scripts' dapo reward keys, lengths scaled to the demo's 4
    """The gspo / sapo scripts' legacy dapo reward kwargs (max response 8192, buffer 4096), at the demo's
    response length."""
    from async_rl.demo.task import RESPONSE_LENGTH

    kwargs = "+reward_model.reward_kwargs"
    return {f"{kwargs}.overlong_buffer_cfg.enable": enable, f"{kwargs}.overlong_buffer_cfg.len": RESPONSE_LENGTH // 2,
            f"{kwargs}.overlong_buffer_cfg.penalty_factor": 1.0, f"{kwargs}.overlong_buffer_cfg.log": False,
            f"{kwargs}.max_resp_len": RESPONSE_LENGTH}


EXAMPLES = {
    "rloo_trainer/run_qwen2-7b.sh": {
        "algorithm.adv_estimator": "rloo", f"{ACTOR}.use_kl_loss": False, "actor_rollout_ref.rollout.n": 5,
        "algorithm.use_kl_in_reward": True, "algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.kl_coef": 0.001,
    },
    "reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh": {
        "algorithm.adv_estimator": "reinforce_plus_plus", f"{ACTOR}.use_kl_loss": False,
        f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "mse", f"{ACTOR}.entropy_coeff": 0,
        "actor_rollout_ref.rollout.n": 8, "algorithm.use_kl_in_reward": True,
    },
    "gpg_trainer/run_qwen2-7b_math.sh": {
        "algorithm.adv_estimator": "gpg", f"{ACTOR}.use_kl_loss": False, f"{ACTOR}.policy_loss.loss_mode": "gpg",
        f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "low_var_kl", f"{ACTOR}.entropy_coeff": 0,
        "actor_rollout_ref.rollout.n": 5, "algorithm.use_kl_in_reward": False,
    },
    "gspo_trainer/test_gspo_3b_math.sh": {
        "algorithm.adv_estimator": "grpo", f"{ACTOR}.policy_loss.loss_mode": "gspo",
        f"{ACTOR}.loss_agg_mode": "seq-mean-token-mean", "reward_model.reward_manager": "dapo",
        **OVERLONG(False), "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.0,
        f"{ACTOR}.use_kl_loss": False, f"{ACTOR}.kl_loss_coef": 0.0, f"{ACTOR}.clip_ratio_low": 0.0003,
        f"{ACTOR}.clip_ratio_high": 0.0004, "actor_rollout_ref.rollout.n": 16, f"{ACTOR}.entropy_coeff": 0,
        f"{ROLLOUT}.val_kwargs.top_p": 0.7, f"{ROLLOUT}.val_kwargs.do_sample": True, f"{ROLLOUT}.val_kwargs.n": 1,
        "trainer.log_val_generations": 2,
    },
    "sapo_trainer/run_qwen30b_sapo.sh": {
        "algorithm.adv_estimator": "grpo", f"{ACTOR}.policy_loss.loss_mode": "sapo", f"{ACTOR}.tau_pos": 1.0,
        f"{ACTOR}.tau_neg": 1.05, "algorithm.use_kl_in_reward": False, "algorithm.kl_ctrl.kl_coef": 0.001,
        "algorithm.gamma": 1.0, "algorithm.lam": 0.95, f"{ACTOR}.use_kl_loss": False, f"{ACTOR}.kl_loss_coef": 0.001,
        "actor_rollout_ref.rollout.n": 16, f"{ROLLOUT}.val_kwargs.top_p": 0.7, f"{ROLLOUT}.val_kwargs.n": 1,
        "reward_model.reward_manager": "dapo", **OVERLONG(True), "trainer.critic_warmup": 0,
        "trainer.log_val_generations": 100,
    },
    "rollout_correction/run_with_rollout_corr.sh": {
        "algorithm.adv_estimator": "rloo", "algorithm.gamma": 1.0, f"{CORR}.rollout_is": "sequence",
        f"{CORR}.rollout_is_threshold": 2.0, f"{CORR}.rollout_is_batch_normalize": True, f"{CORR}.rollout_rs": None,
        f"{CORR}.rollout_rs_threshold": None, f"{CORR}.bypass_mode": True, f"{CORR}.loss_type": "reinforce",
        f"{ACTOR}.ppo_epochs": 1, f"{ROLLOUT}.calculate_log_probs": True,
    },
    "ppo_trainer/run_qwen2-7b_rm_seq_balance.sh": {  # verl's rollout.name=vllm, here the CPU backend's server
        "algorithm.adv_estimator": "gae", f"{ACTOR}.use_kl_loss": False, "reward_model.enable": True,
        "reward_model.model.path": "{demo}/reward_model", "reward_model.rollout.name": "cpu",
        "reward_model.rollout.gpu_memory_utilization": 0.8, "reward_model.rollout.tensor_model_parallel_size": 1,
        "reward_model.rollout.prompt_length": 32, "reward_model.rollout.response_length": 8,
        "reward_model.num_workers": 1, "algorithm.use_kl_in_reward": False, "trainer.critic_warmup": 0,
        "critic.use_dynamic_bsz": True,
    },
    "cispo_trainer/run_cispo_qwen2_5_0_5b_gsm8k.sh": {
        "algorithm.adv_estimator": "grpo", f"{ACTOR}.policy_loss.loss_mode": "cispo",
        f"{ACTOR}.clip_ratio_low": 10, f"{ACTOR}.clip_ratio_high": 0.2, f"{ACTOR}.use_kl_loss": True,
        f"{ACTOR}.kl_loss_coef": 0.001, f"{ACTOR}.kl_loss_type": "low_var_kl", f"{ACTOR}.entropy_coeff": 0,
        "actor_rollout_ref.rollout.n": 5, "algorithm.use_kl_in_reward": False,
    },
}
STEPS = 2
DEMO_SIZES = {"data.train_batch_size": 8, f"{ACTOR}.ppo_mini_batch_size": 8, "trainer.total_training_steps": STEPS,
              "trainer.test_freq": -1, "trainer.val_before_train": False}
FLAGS = {"with the flag": {}, "verl's trainer": {"+actor_rollout_ref.async_pipeline": False}}
TIMEOUT_S = 900


def run_keys(script: str, demo_dir: Path) -> dict:
    """The keys one example runs with: its script's, the demo's sizes, a validation at the last step where the
    script logs validation generations (its test_freq is past 2 steps)."""
    return with_demo_sizes({k: v.format(demo=demo_dir) if isinstance(v, str) else v for k, v in EXAMPLES[script].items()})


def with_demo_sizes(keys: dict) -> dict:
    """`keys` with the demo's sizes (DEMO_SIZES, and with a critic `critic.ppo_mini_batch_size` of one step's
    prompts: verl's trainer pads each batch with empty samples to a multiple of the critic's mini-batch, and
    actor mini-batches made only of them log pg_loss NaN), and a validation at the last step where they log
    validation generations (`trainer.log_val_generations` above 0, as a number or as a script types it)."""
    logs = str(keys.get("trainer.log_val_generations", 0)) not in ("0", "None", "null", "False")
    critic = {"critic.ppo_mini_batch_size": DEMO_SIZES["data.train_batch_size"]} if with_critic(keys) else {}
    return {**keys, **DEMO_SIZES, **critic, **({"trainer.test_freq": STEPS} if logs else {})}


def with_critic(keys: dict) -> bool:
    """The demo's critic (its model, sizes) for a script that trains one (gae)."""
    return keys.get("algorithm.adv_estimator") == "gae"


ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")


def error_line(log_tail: str) -> str:
    """The last line of a failed run's log tail that names an error or exception (not a warning), else its last
    line; colour codes removed, at most 200 characters."""
    lines = [ANSI_CODES.sub("", line).strip() for line in log_tail.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"(Error|Exception)\b", line) and "WARNING" not in line]
    return (named or lines or [""])[-1][:200]


def run_one(name: str, keys: dict, demo_dir: Path, workdir: Path, as_typed: bool = False) -> dict:
    """One 2-step run; {"trained": bool, "seconds", "pg_loss", "advantages_mean"} or the error's last line.
    `as_typed`: the values of `keys` are override text as a script types it (its quoting kept), given to Hydra
    unchanged."""
    workdir.mkdir(parents=True)
    start = time.monotonic()
    extra = [f"{key}={value}" for key, value in keys.items()] if as_typed else keys
    try:
        rows = run_system(name, demo_dir, workdir, workdir / "metrics.jsonl", extra, TIMEOUT_S, critic=with_critic(keys))
    except RuntimeError as exc:
        return {"trained": False, "seconds": time.monotonic() - start, "error": error_line(str(exc))}
    steps = {r["step"]: r["data"] for r in rows if "actor/pg_loss" in r["data"]}
    last = steps.get(STEPS, {})
    return {"trained": sorted(steps) == list(range(1, STEPS + 1)), "seconds": time.monotonic() - start,
            "pg_loss": last.get("actor/pg_loss"), "advantages_mean": last.get("critic/advantages/mean")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=",".join(EXAMPLES), help="comma-separated keys of EXAMPLES")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    command = command_line()
    from async_rl.demo import prepare

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        demo_dir = Path(tmp) / "demo"
        prepare(demo_dir, seed=0)
        for i, script in enumerate(filter(None, args.examples.split(","))):
            for j, (label, flag) in enumerate(FLAGS.items()):
                result = run_one(f"{script} ({label})", {**run_keys(script, demo_dir), **flag}, demo_dir,
                                 Path(tmp) / f"run{i}_{j}")
                results.setdefault(script, {})[label] = result
                print(f"{script} | {label}: {'trained' if result['trained'] else 'FAILED'} "
                      f"in {result['seconds']:.0f} s", flush=True)
    print(f"\n{command}\n")
    print("| verl example | " + " | ".join(FLAGS) + " |")
    print("|---|" + "---|" * len(FLAGS))
    for script, by_flag in results.items():
        cells = []
        for label in FLAGS:
            r = by_flag[label]
            loss = "nan" if r.get("pg_loss") is None else f"{r['pg_loss']:.4f}"  # verl's file logger writes NaN as null
            cells.append(f"trained {STEPS} steps in {r['seconds']:.0f} s (pg_loss {loss})" if r["trained"]
                         else f"failed: {r.get('error', 'steps missing')}")
        print(f"| `{script}` | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "results": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
