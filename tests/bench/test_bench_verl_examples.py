"""bench/verl_examples.py's table: each example with the flag and flag off, trained or the error's last line
(the runs themselves faked here; the flag-on half runs for real in tests/e2e/test_verl_examples_e2e.py)."""

from __future__ import annotations

import json

from bench import verl_examples


def test_the_table_says_per_example_and_flag_whether_it_trained(monkeypatch, tmp_path, capsys):
    prepared = []
    monkeypatch.setattr("async_rl.demo.prepare", lambda path, seed: prepared.append(seed))

    def fake_run(name, demo_dir, workdir, metrics_path, extra, timeout_s, critic=False):
        if extra.get("+actor_rollout_ref.async_pipeline") is False:  # verl's trainer fails, say
            raise RuntimeError(f"{name} failed after 3 s (log: x):\nTraceback\nKeyError: 'reward_baselines'\n")
        assert extra["trainer.total_training_steps"] == 2 and extra["algorithm.adv_estimator"] == "rloo"
        assert not critic and extra["trainer.test_freq"] == -1  # no critic, no validation in rloo's script
        return [{"step": s, "data": {"actor/pg_loss": 0.5 * s, "critic/advantages/mean": 0.0}} for s in (1, 2)]

    monkeypatch.setattr(verl_examples, "run_system", fake_run)
    out = tmp_path / "r.json"
    results = verl_examples.main(["--examples", "rloo_trainer/run_qwen2-7b.sh", "--json", str(out)])
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if line.startswith("| `rloo_trainer"))
    assert "trained 2 steps in" in row and "(pg_loss 1.0000)" in row and "failed: KeyError: 'reward_baselines'" in row
    assert "python" in printed and "  # at commit " in printed and prepared == [0]
    saved = json.loads(out.read_text())["results"]["rloo_trainer/run_qwen2-7b.sh"]
    assert saved["with the flag"]["trained"] and not saved["verl's trainer"]["trained"]
    assert results == json.loads(out.read_text())["results"]


def test_examples_get_the_demos_critic_reward_model_and_a_last_validation_where_their_script_needs_them(tmp_path):
    rm = verl_examples.run_keys("ppo_trainer/run_qwen2-7b_rm_seq_balance.sh", tmp_path)
    assert rm["reward_model.model.path"] == f"{tmp_path}/reward_model" and verl_examples.with_critic(rm)
    # the critic's mini-batch is one step's prompts, so verl's trainer does not pad the batch with empty samples
    sizes = ("critic.ppo_mini_batch_size", "data.train_batch_size", f"{verl_examples.ACTOR}.ppo_mini_batch_size")
    assert len({rm[key] for key in sizes}) == 1
    gspo = verl_examples.run_keys("gspo_trainer/test_gspo_3b_math.sh", tmp_path)
    assert gspo["trainer.log_val_generations"] == 2 and gspo["trainer.test_freq"] == 2  # validates at step 2
    assert not verl_examples.with_critic(gspo) and "critic.ppo_mini_batch_size" not in gspo


def test_a_nan_loss_shows_as_nan(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("async_rl.demo.prepare", lambda path, seed: None)

    def fake_run(name, demo_dir, workdir, metrics_path, extra, timeout_s, critic=False):  # NaN: null in verl's file
        return [{"step": s, "data": {"actor/pg_loss": None, "critic/advantages/mean": 0.0}} for s in (1, 2)]

    monkeypatch.setattr(verl_examples, "run_system", fake_run)
    verl_examples.main(["--examples", "rloo_trainer/run_qwen2-7b.sh"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| `rloo_trainer"))
    assert row.count("(pg_loss nan)") == 2


def test_a_failed_runs_error_is_the_last_line_naming_one_not_a_warning_after_it():
    from bench.verl_examples import error_line

    tail = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "\x1b[36m(TaskRunner pid=1)\x1b[0m FileNotFoundError: /path/saved/lora_adapter\n"
            "\x1b[36m(WorkerDict pid=2)\x1b[0m WARNING: target_num_threads 8 should not exceed 2 (ValueError-free)\n\n")
    assert error_line(tail) == "(TaskRunner pid=1) FileNotFoundError: /path/saved/lora_adapter"
    assert error_line("just stopped\nno reason given\n") == "no reason given"
    assert error_line("") == ""
