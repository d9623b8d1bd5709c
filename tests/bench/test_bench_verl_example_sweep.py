"""bench/verl_example_sweep.py: verl's example scripts run under bash with a recorder in place of python, their
main_ppo calls put through the start checks with the flag and without it, and their training keys cut to
those a demo run keeps. Scripts written here stand in for verl's (CI has no checkout of verl's examples/); the
demo runs themselves are faked (they are bench/verl_examples.py's `run_one`, tested there and in e2e)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from bench import verl_example_sweep as sweep

SCRIPTS = {
    # a GRPO script as verl writes them: variables, quoting, `$@`, the demo's machine in place of 8 GPUs
    "grpo_trainer/run_ok.sh": """set -x
lr=3e-6
python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=rloo \\
    data.train_files=$HOME/data/gsm8k/train.parquet \\
    data.val_files="$HOME/data/gsm8k/test.parquet" \\
    actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct \\
    actor_rollout_ref.actor.optim.lr=$lr \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40 \\
    actor_rollout_ref.rollout.name=cpu \\
    actor_rollout_ref.rollout.n=5 \\
    actor_rollout_ref.actor.checkpoint.save_contents="['model','hf_model']" \\
    trainer.device=cpu \\
    trainer.n_gpus_per_node=2 \\
    trainer.logger='["console","wandb"]' $@
""",
    # launched through Ray's job CLI, with a key the pipeline cannot run
    "ppo_trainer/run_refused.sh": """set -euo pipefail
nvidia-smi
ray job submit --address=http://127.0.0.1:8265 -- python3 -m verl.trainer.main_ppo \\
    algorithm.adv_estimator=grpo actor_rollout_ref.rollout.name=cpu trainer.device=cpu trainer.n_gpus_per_node=2 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4 \\
    actor_rollout_ref.rollout.profiler.enable=True
""",
    # one that stops before its call: an environment file of another machine
    "npu/run_elsewhere.sh": """set -e
source /nonexistent/ascend/set_env.sh
python3 -m verl.trainer.main_ppo trainer.device=npu
""",
    "sft/run_sft.sh": "torchrun --nproc_per_node=2 -m verl.trainer.fsdp_sft_trainer data.train_batch_size=4\n",
}


@pytest.fixture(scope="module")
def swept(demo_dir, tmp_path_factory):
    examples = tmp_path_factory.mktemp("examples")
    for name, text in SCRIPTS.items():
        (examples / name).parent.mkdir(parents=True, exist_ok=True)
        (examples / name).write_text(text)
    return sweep.sweep(examples, demo_dir, tmp_path_factory.mktemp("sweep"))


def by_script(rows: list[dict]) -> dict:
    return {row["script"]: row for row in rows}


def test_a_call_the_flag_can_run_passes_both_checks_and_keeps_only_its_training_keys(swept):
    row = by_script(swept)["grpo_trainer/run_ok.sh"]
    assert row["main_ppo"] and row["with_flag"]["passed"], row["with_flag"]
    assert row["verl_alone"]["passed"], row["verl_alone"]
    assert row["adapted"]["passed"], row["adapted"]  # its keys on the demo's data, model and CPU devices
    # the shell expanded the script's variables; data, models, sizes, devices and logging are the demo's
    assert row["run_keys"] == {"algorithm.adv_estimator": "rloo", "actor_rollout_ref.actor.optim.lr": "3e-6",
                               "actor_rollout_ref.rollout.n": "5",
                               "actor_rollout_ref.actor.checkpoint.save_contents": "['model','hf_model']"}


def test_a_refused_key_is_named_by_the_pipelines_check_while_verl_alone_passes(swept):
    row = by_script(swept)["ppo_trainer/run_refused.sh"]
    assert row["main_ppo"], row  # found after `ray job submit --`
    assert not row["with_flag"]["passed"] and row["with_flag"]["check"] == "pipeline"
    assert "actor_rollout_ref.rollout.profiler.enable" in row["with_flag"]["message"]
    assert row["verl_alone"]["passed"]
    assert not row["adapted"]["passed"] and "profiler.enable" in row["adapted"]["message"]  # a training key: kept
    assert row["adapted_verl"]["passed"] and sweep.refused_by_the_flag_only(row)  # verl's checks take it on the demo
    ok = by_script(swept)["grpo_trainer/run_ok.sh"]
    assert ok["adapted_verl"]["passed"] and not sweep.refused_by_the_flag_only(ok)


def test_a_script_that_stops_before_its_call_says_where_and_one_without_main_ppo_says_what_it_calls(swept):
    rows = by_script(swept)
    stopped = rows["npu/run_elsewhere.sh"]
    assert not stopped["main_ppo"] and stopped["names_main_ppo"] and stopped["bash_exit"] != 0
    assert "/nonexistent/ascend/set_env.sh" in stopped["last_error"]
    sft = rows["sft/run_sft.sh"]
    assert not sft["main_ppo"] and not sft["names_main_ppo"] and sft["calls"] == ["torchrun"]
    assert "its text names main_ppo, not reached" in sweep.row_text(stopped)[0]
    assert sweep.row_text(sft)[0] == "no main_ppo call; calls torchrun"


def test_the_summary_counts_each_kind_and_the_table_has_a_row_per_call(swept):
    lines = sweep.summary(swept)
    assert lines[0] == "4 scripts; 2 main_ppo calls in 2 of them; 2 scripts call no main_ppo"
    assert lines[1].startswith("as written: 1 calls pass the start checks with the flag and without it; 1 pass verl's "
                               "alone and are stopped with the flag; 0 are stopped without the flag too")
    assert lines[2:4] == ["as written, stopped with the flag only, by what stopped them (calls):",
                          "  1 pipeline: actor_rollout_ref.rollout.profiler.enable"]
    adapted = lines.index(next(line for line in lines if line.startswith("adapted to the demo")))
    assert lines[adapted].endswith("1 calls pass the flag's start checks, 1 are stopped:")
    assert lines[adapted + 1] == "  1 pipeline: actor_rollout_ref.rollout.profiler.enable"
    assert "adapted, verl's own start checks (flag off): 2 calls pass; 1 of them are stopped by the flag's" in lines
    table = sweep.table(swept)
    assert len(table) == 2 + len(SCRIPTS)
    assert any(line.startswith("| `ppo_trainer/run_refused.sh` | stopped by pipeline:") for line in table)


def test_config_path_is_taken_from_main_ppos_folder_unless_absolute(tmp_path):
    config_dir = tmp_path / "verl" / "trainer" / "config"
    call = sweep.main_ppo_call(["python3", "-m", "verl.trainer.main_ppo", "--config-path=config",
                                "--config-name", "ppo_megatron_trainer.yaml", "a.b=1", "~c.d", "positional"], config_dir)
    assert call.config_dir == str(config_dir) and call.config_name == "ppo_megatron_trainer.yaml"
    assert call.overrides == ["a.b=1", "~c.d"]
    call = sweep.main_ppo_call(["python3", "verl/trainer/main_ppo.py", "--config-path", "/abs/conf", "x=1"], config_dir)
    assert call.config_dir == "/abs/conf" and call.config_name == "ppo_trainer" and call.overrides == ["x=1"]
    assert sweep.main_ppo_call(["python3", "-m", "verl.trainer.main_generation", "x=1"], config_dir) is None


def test_the_demo_owns_files_sizes_and_devices_and_names_the_reward_models_backend():
    call = sweep.Call("", "ppo_trainer", [
        "+reward_model.rollout.name=vllm", "reward_model.enable=True", "critic.ppo_micro_batch_size_per_gpu=8",
        "critic.optim.lr=1e-5", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", "+actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "algorithm.rollout_correction.rollout_is=sequence", "trainer.use_legacy_worker_impl=disable"])
    assert sweep.demo_run_keys(call) == {
        "+reward_model.rollout.name": "cpu", "reward_model.enable": "True", "critic.optim.lr": "1e-5",
        "+actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "algorithm.rollout_correction.rollout_is": "sequence",
        "trainer.use_legacy_worker_impl": "disable"}


def test_file_keys_point_at_the_demo_and_the_stand_in_model(tmp_path):
    out = sweep.with_demo_files(["data.train_files=/x.parquet", "+critic.model.path=/m", "~data.val_files", "a=1"],
                                tmp_path / "demo", tmp_path / "model")
    assert out == [f"data.train_files={tmp_path}/demo/data/train.parquet", f"+critic.model.path={tmp_path}/model",
                   "~data.val_files", "a=1"]


def test_distinct_runs_group_the_calls_that_would_train_alike_and_each_row_gets_its_result(monkeypatch, tmp_path):
    verdict = {"check": "pipeline", "message": "m"}
    rows = [{"script": s, "call": 0, "main_ppo": True, "with_flag": {"passed": True}, "verl_alone": {"passed": True},
             "adapted": {"passed": passed, **verdict}, "run_keys": keys}
            for s, passed, keys in [("a.sh", True, {"x": "1"}), ("b.sh", True, {"x": "1"}), ("c.sh", True, {"x": "2"}),
                                    ("d.sh", False, {"x": "3"})]]
    runs = sweep.runs_to_make(rows)
    assert [[r["script"] for r in group] for group in runs.values()] == [["a.sh", "b.sh"], ["c.sh"]]
    made = []

    def fake_run_one(name, keys, demo_dir, workdir, as_typed=False):
        assert as_typed  # the scripts' values go to Hydra as they typed them
        made.append((name, keys))
        return {"trained": keys["x"] == "1", "seconds": 5.0, "error": "KeyError: 'y'"}

    monkeypatch.setattr("bench.verl_examples.run_one", fake_run_one)
    sweep.train_runs(runs, tmp_path, tmp_path)
    assert [name for name, _ in made] == ["a.sh", "c.sh"]
    assert made[0][1]["trainer.total_training_steps"] == 2  # the demo's sizes on every run
    assert rows[1]["run"]["trained"] and not rows[2]["run"]["trained"] and "run" not in rows[3]
    assert "demo runs under the flag: 2 of 3 calls trained 2 steps (2 distinct runs)" in sweep.summary(rows)
    assert json.dumps(sweep.table(rows)).count("failed: KeyError") == 1


def test_the_stand_in_model_has_the_heads_a_sequence_parallel_size_divides(demo_dir, tmp_path):
    model = sweep.stand_in_model(Path(demo_dir) / "model", tmp_path / "m")
    assert json.loads((model / "config.json").read_text())["num_attention_heads"] == sweep.STAND_IN_HEADS
    assert (model / "tokenizer_config.json").exists()


def test_verls_trainer_runs_the_calls_only_the_flag_stops_and_the_summary_says_which_trained(monkeypatch, tmp_path):
    stopped = {"passed": False, "check": "pipeline", "message": "invalid config: a.b=1; allowed: no"}
    rows = [{"script": s, "call": 0, "main_ppo": True, "with_flag": {"passed": True}, "verl_alone": {"passed": True},
             "adapted": adapted, "adapted_verl": {"passed": verl_passes}, "run_keys": keys}
            for s, adapted, verl_passes, keys in [("ok.sh", {"passed": True}, True, {"x": "1"}),
                                                  ("p.sh", stopped, True, {"x": "2"}), ("q.sh", stopped, True, {"x": "3"}),
                                                  ("v.sh", stopped, False, {"x": "4"})]]
    runs = sweep.runs_to_make(rows, flag=False)
    assert [[r["script"] for r in group] for group in runs.values()] == [["p.sh"], ["q.sh"]]
    made = []

    def fake_run_one(name, keys, demo_dir, workdir, as_typed=False):
        made.append(keys)
        return {"trained": keys["x"] == "2", "seconds": 7.0, "error": "ModuleNotFoundError: m"}

    monkeypatch.setattr("bench.verl_examples.run_one", fake_run_one)
    sweep.train_runs(runs, tmp_path, tmp_path, flag=False)
    assert all(keys["+actor_rollout_ref.async_pipeline"] == "false" for keys in made)  # verl's own trainer
    assert rows[1]["verl_run"]["trained"] and not rows[2]["verl_run"]["trained"] and "run" not in rows[1]
    lines = sweep.summary(rows)
    assert "verl's own trainer on those, 2 demo steps: 1 of 2 calls trained (2 distinct runs); by what stopped the " \
           "flag (calls: trained by verl's trainer / failed there):" in lines
    assert "  pipeline: a.b: 1 / 1" in lines
    table = "\n".join(sweep.table(rows))
    assert "| trained in 7 s |" in table and "| failed: ModuleNotFoundError: m |" in table


def test_the_results_show_the_sweeps_temporary_folder_as_a_placeholder(tmp_path, capsys):
    examples = tmp_path / "examples"
    (examples / "t").mkdir(parents=True)  # a script naming a file of its own tree, which the sweep copies
    (examples / "t" / "run.sh").write_text(
        "python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=cpu trainer.device=cpu "
        "actor_rollout_ref.rollout.multi_turn.tool_config_path=$(pwd)/examples/t/tools.yaml\n")
    results = tmp_path / "sweep.json"
    sweep.main(["--examples-dir", str(examples), "--json", str(results)])
    printed, saved = capsys.readouterr().out, results.read_text()
    placeholder = f"{sweep.WORKDIR}/sweep/cwd/examples/t/tools.yaml"
    assert placeholder in printed and placeholder in saved
    assert tempfile.gettempdir() + "/" not in printed.split("\n\n", 1)[1] and tempfile.gettempdir() + "/" not in saved
