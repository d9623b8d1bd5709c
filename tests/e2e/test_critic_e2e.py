"""End to end: verl's PPO (gae with a critic) through the pipeline (its checkpoints: test_verl_trainer_on_cpu); and
the table of verl's keys (async_rl/core/verl_key_table.py) against the keys this run reads, recorded in every
process (async_rl/core/key_reads.py)."""

from __future__ import annotations

import pytest

from async_rl.core import key_reads
from async_rl.demo import demo_overrides
from async_rl.demo.task import GROUP_SIZE, TRAIN_BATCH_SIZE
from helpers.key_table_record import disagreements
from helpers.lineage import compose_ppo
from helpers.rows import every_step_with, val_rows
from helpers.runs import run_verl
from state_machines.actor_train import trainable_rows

CRITIC_KEYS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
               "timing_s/update_critic", "timing_s/values", "critic/values/mean", "critic/returns/mean",
               "critic/vf_explained_var", "async/values/busy_ratio", "async/critic_train/busy_ratio")
USER_STAGE = {"+trainer.async_stages.group_filter.cls": "examples.group_filter_stage.GroupFilterStage",
              "+trainer.async_stages.group_filter.after": "reward"}
K, STEPS, WARMUP = 3, 5, 2
# verl's torch profiler on the critic's ranks at step 3: its values pass and update
PROFILED = {"global_profiler.tool": "torch", "global_profiler.steps": [3], "critic.profiler.enable": True,
            "critic.profiler.all_ranks": True}
RUN = {"trainer.total_training_steps": STEPS, "trainer.test_freq": STEPS, "+trainer.generate_ahead_steps": K,
       "trainer.critic_warmup": WARMUP, **USER_STAGE, **PROFILED}


@pytest.fixture(scope="module")
def critic_run(demo_dir, tmp_path_factory, ray_address):
    """The run, with every process recording the config keys it reads (the driver from its environment, the
    Ray workers from the job's runtime env): (exit code, output, metric rows, the records' folder)."""
    workdir = tmp_path_factory.mktemp("critic")
    reads = workdir / "key_reads"
    recording = {f"+ray_kwargs.ray_init.runtime_env.env_vars.{key_reads.ENV}": str(reads),
                 "global_profiler.save_path": str(workdir / "profile")}
    with pytest.MonkeyPatch.context() as env:
        env.setenv(key_reads.ENV, str(reads))
        code, out, rows = run_verl(demo_dir, {**RUN, **recording}, workdir, critic=True, ray_address=ray_address)
    return code, out, rows, reads, workdir


def test_ppo_with_a_critic_trains_with_values_from_the_critic_of_its_step(critic_run):
    """k = 3: each step's values come from the critic after the previous steps' updates (verl's order),
    the critic trains on every step, with trainer.critic_warmup=2 the actor makes no update at step 1,
    and a user stage inserted from the command line filters what both train."""
    code, out, rows, _, workdir = critic_run
    assert code == 0, out[-4000:]
    traces = sorted(path.name.partition("_rank")[0] for path in (workdir / "profile").iterdir())
    assert traces == ["value-model_step3"], traces  # verl's name: the critic's model type, the step
    by_step = every_step_with(rows, STEPS, CRITIC_KEYS)
    for step, metrics in by_step.items():
        assert metrics["async/critic_version"] == step - 1  # the rule: batch j's values from critic version j
        assert metrics["async/staleness/max"] <= K - 1
        assert metrics["critic/vf_clipfrac"] >= 0 and metrics["critic/grad_norm"] > 0
        assert ("actor/pg_loss" in metrics) == (step >= WARMUP)
        # the user stage (examples/group_filter_stage.py, two config lines) between reward and actor_train
        assert "async/group_filter/busy_ratio" in metrics
        kept_groups = metrics["async/group_filter/kept_groups"]
        assert metrics["async/group_filter/kept_ratio"] == kept_groups / TRAIN_BATCH_SIZE
        # the filter's decision reached the update: only rows of kept groups were trained
        expected = trainable_rows(int(kept_groups) * GROUP_SIZE, TRAIN_BATCH_SIZE * GROUP_SIZE, 1, GROUP_SIZE)
        assert metrics["async/trained_rows"] == expected
    assert max(m["async/staleness/max"] for m in by_step.values()) >= 1
    assert "val-core/async_rl/copy_digits/reward/mean@1" in val_rows(rows)[STEPS]


def test_the_key_table_says_what_the_run_read(critic_run, demo_dir):
    """Every PIPELINE row's keys read by the pipeline, every VERL row's reaching a verl class, no NO_EFFECT
    key read, except the keys only a setting this run leaves off reads (helpers/key_table_record.py, ONLY_WITH)."""
    code, out, _, reads, _ = critic_run
    assert code == 0, out[-4000:]
    records = key_reads.read_records(str(reads))
    assert {r["reader"] for r in records if r["how"] == "class"} >= {  # the driver, the stages' host, the workers
        "verl.workers.config.FSDPActorConfig", "verl.workers.config.FSDPCriticConfig",
        "verl.workers.config.RolloutConfig"}
    lines = disagreements(records, compose_ppo(demo_overrides(demo_dir, extra=RUN, critic=True)))
    assert not lines, f"{len(lines)} keys whose row the run contradicts:\n" + "\n".join(lines)
