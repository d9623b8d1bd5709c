"""verl settings the pipeline cannot honour are refused before Ray starts, naming the key
(async_rl/core/verl_keys.py), and the files a command names are checked then too."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import AdvantageEstimator

from async_rl.core.errors import AsyncConfigError
from async_rl.core.verl_keys import OPTIMAL_TOKEN_BASELINES, UNSUPPORTED
from async_rl.demo import demo_overrides
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo

REFUSED = [
    ({"algorithm.adv_estimator": "optimal_token_baseline"}, "algorithm.adv_estimator='optimal_token_baseline'",
     "sum_pi_squared"),
    ({"algorithm.adv_estimator": "tir_optimal_token_baseline"}, "tir_optimal_token_baseline", "sum_pi_squared"),
    ({"reward.reward_model.enable": True, "reward.reward_model.rollout.name": "sglang"},
     "reward.reward_model.rollout.name='sglang'", "no run has served a reward model on SGLang"),
    ({"reward.reward_model.enable": True, "reward.reward_model.rollout.name": "vllm"},
     "reward.reward_model.enable_resource_pool=False", "True with reward.reward_model.rollout.name=vllm"),
    ({"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.rollout.name": "sglang"},
     "actor_rollout_ref.model.lora_rank=8", "0 with actor_rollout_ref.rollout.name=sglang"),
    ({"actor_rollout_ref.model.lora.rank": 8}, "actor_rollout_ref.model.lora.rank=8", "set actor_rollout_ref.model.lora_rank"),
    ({"actor_rollout_ref.rollout.prometheus.enable": True}, "actor_rollout_ref.rollout.prometheus.enable=True",
     "False with actor_rollout_ref.rollout.name=cpu (Prometheus scrapes /metrics"),
]


@pytest.mark.parametrize("extra,named,why", REFUSED)
def test_a_setting_the_pipeline_cannot_run_is_refused_before_ray_starts(demo_dir, extra, named, why):
    with pytest.raises(AsyncConfigError, match="invalid config") as refused:
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra=extra)))
    assert named in str(refused.value) and why in str(refused.value)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "gpg", "grpo_passk", "opo", "remax"])
def test_the_estimators_it_runs_are_not_refused(demo_dir, estimator):
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra={"algorithm.adv_estimator": estimator})))
    assert run.config.algorithm.adv_estimator == estimator


def test_prometheus_on_vllm_is_not_refused(demo_dir):
    from async_rl.core.verl_keys import refuse_unsupported

    refuse_unsupported(compose_ppo(demo_overrides(demo_dir, extra={"actor_rollout_ref.rollout.prometheus.enable": True,
                                                                   "actor_rollout_ref.rollout.name": "vllm"})))


def test_lora_on_the_cpu_backend_is_not_refused(demo_dir):
    from async_rl.core.verl_keys import replaced_settings
    from async_rl.demo.task import LORA_OVERRIDES

    run = read_run_config(compose_ppo(demo_overrides(demo_dir, lora=True)))
    assert run.config.actor_rollout_ref.model.lora_rank == int(LORA_OVERRIDES["actor_rollout_ref.model.lora_rank"]) > 0
    merged = compose_ppo(demo_overrides(demo_dir, lora=True, extra={"actor_rollout_ref.model.lora.merge": True}))
    read_run_config(merged)  # verl's merged-weights sync: the adapter alone serves the same policy, logged
    assert any(line.startswith("actor_rollout_ref.model.lora.merge=True is not used: the pipeline sends the adapter")
               for line in replaced_settings(merged))


def test_the_table_names_real_verl_keys_and_estimators(demo_dir):
    from omegaconf import OmegaConf

    config = compose_ppo(demo_overrides(demo_dir))
    for rule in UNSUPPORTED:  # a misspelt key would never refuse anything
        assert OmegaConf.select(config, rule.key, default="<absent>") != "<absent>", rule.key
        assert not rule.refuses(OmegaConf.select(config, rule.key)), f"{rule.key}: verl's default is refused"
    estimators = {e.value for e in AdvantageEstimator}
    assert "remax" in estimators and set(OPTIMAL_TOKEN_BASELINES) <= estimators


def test_a_missing_reward_file_fails_before_ray_starts_naming_the_key(demo_dir, tmp_path):
    key, missing = "reward.custom_reward_function.path", tmp_path / "no_such_reward.py"
    with pytest.raises(FileNotFoundError, match=f"{key}='{missing}': no such file"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: str(missing)})))
    with pytest.raises(FileNotFoundError, match=f"{key}='{missing}'"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: f"file://{missing}"})))


def test_a_missing_lora_adapter_fails_before_ray_starts_naming_the_key(demo_dir, tmp_path):
    # verl's LoRA-from-adapter example names `/path/saved/lora_adapter`: found only once the workers loaded it
    key = "actor_rollout_ref.model.lora_adapter_path"
    extra = {key: str(tmp_path / "missing"), "actor_rollout_ref.model.lora_rank": 8}
    with pytest.raises(FileNotFoundError, match=f"{key}='{tmp_path / 'missing'}': no such file"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra=extra)))


def test_a_reward_model_on_the_cpu_backend_is_checked_before_ray_starts(demo_dir, tmp_path):
    rm = {"reward.reward_model.enable": True, "reward.reward_model.rollout.name": "cpu"}
    key = "reward.reward_model.model_path"
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**rm, key: str(demo_dir / "reward_model")})))
    assert run.config.reward.reward_model.enable
    with pytest.raises(FileNotFoundError, match=f"{key}='{tmp_path / 'none'}': no such file"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**rm, key: str(tmp_path / "none")})))
    with pytest.raises(AsyncConfigError, match="a generative one needs vLLM or SGLang"):  # a causal LM
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**rm, key: str(demo_dir / "model")})))


def test_a_reward_model_on_vllm_takes_devices_of_its_own_and_vllms_cpu_settings(demo_dir, monkeypatch):
    import dataclasses

    from async_rl.api.rollout import register_rollout_backend, rollout_backend
    from async_rl.run_config import ray_init_kwargs

    rm = {"reward.reward_model.enable": True, "reward.reward_model.rollout.name": "vllm",
          "reward.reward_model.model_path": str(demo_dir / "reward_model"), "reward.reward_model.enable_resource_pool": True,
          "reward.reward_model.n_gpus_per_node": 2, "reward.reward_model.nnodes": 1}
    with pytest.raises(AsyncConfigError) as refused:  # this venv has no vLLM
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra=rm)))
    assert "reward.reward_model.rollout.name='vllm'" in str(refused.value) and "vLLM's CPU build" in str(refused.value)
    vllm = rollout_backend("vllm")
    register_rollout_backend(dataclasses.replace(vllm, unavailable=lambda device: None))  # as where it is installed
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    try:
        run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=rm)))
        ray_init = ray_init_kwargs(run.config)
        with pytest.raises(AsyncConfigError, match="reward.reward_model.n_gpus_per_node=2.*at least the 4 devices"):
            read_run_config(compose_ppo(demo_overrides(demo_dir, extra={
                **rm, "reward.reward_model.rollout.tensor_model_parallel_size": 4})))  # verl asserts at its start
    finally:
        register_rollout_backend(vllm)
    served = run.config.reward.reward_model.rollout
    assert served.free_cache_engine is False and served.enable_sleep_mode is False  # vLLM's CPU build: no sleep mode
    assert ray_init["num_gpus"] == 2  # the policy's CPU backend takes none; the reward model its 2
    assert ray_init["runtime_env"]["env_vars"]["VLLM_TARGET_DEVICE"] == "cpu"  # vLLM's CPU build's settings
    assert run.placement.nodes * run.placement.devices_per_node == 2  # the trainer's devices, split as before


# verl's examples/rollout_correction/run_with_rollout_corr.sh: bypass mode, REINFORCE, self-normalised
# sequence-level IS truncated at 2
ROLLOUT_CORR_EXAMPLE = {"algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.loss_type": "reinforce",
                        "algorithm.rollout_correction.rollout_is": "sequence",
                        "algorithm.rollout_correction.rollout_is_threshold": 2.0,
                        "algorithm.rollout_correction.rollout_is_batch_normalize": True}


def test_verls_bypass_mode_loss_runs_with_its_is_settings_against_the_rollouts_log_probs(demo_dir):
    """The actor config the train ranks build (verl's `omega_conf_to_dataclass`, as its worker does) selects
    verl's bypass-mode loss with the script's settings, and the batch's old_log_probs are the rollout's: the
    loss equals REINFORCE weighted by the truncated, batch-normalised sequence ratio pi / pi_behav."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    from async_rl.core.decoupled_ppo import set_behaviour_as_old

    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=ROLLOUT_CORR_EXAMPLE)))
    assert run.async_cfg.decoupled_ppo is False and run.proximal_logp_workers is None  # nothing recomputed
    actor = omega_conf_to_dataclass(run.config.actor_rollout_ref.actor)
    gen = torch.Generator().manual_seed(0)
    rows, length = 6, 5
    mask = (torch.arange(length)[None, :] < torch.tensor([5, 3, 1, 4, 5, 2])[:, None]).float()
    behav = -torch.rand(rows, length, generator=gen, dtype=torch.float64) - 0.1  # each token's own version's
    logp = behav + torch.randn(rows, length, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, length)
    batch = DataProto.from_dict(tensors={"old_log_probs": torch.zeros_like(behav), "rollout_log_probs": behav,
                                         "response_mask": mask})
    set_behaviour_as_old(batch, run.config)
    loss, metrics = get_policy_loss_fn(actor.policy_loss.loss_mode)(
        old_log_prob=batch.batch["old_log_probs"], log_prob=logp, advantages=adv, response_mask=mask.bool(),
        loss_agg_mode=actor.loss_agg_mode, config=actor)
    weight = ((logp - behav) * mask).sum(-1).exp().clamp(max=2.0)  # one truncated weight per sequence
    weight = weight / weight.mean()  # batch-normalised to mean 1
    want = (-adv * logp * weight[:, None] * mask).sum() / mask.sum()  # token-mean, verl's default
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    assert metrics["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(
        float(((logp - behav) * mask).sum(-1).exp().clamp(max=2.0).mean()))


@pytest.mark.parametrize("extra,named", [
    ({"algorithm.rollout_correction.rollout_rs": "token_k1", "algorithm.rollout_correction.rollout_rs_threshold": "0.5_2.0"},
     "rollout_rs"),
    ({"algorithm.rollout_correction.loss_type": "reinforce"}, "loss_type"),
])
def test_bypass_mode_with_rs_or_reinforce_selects_verls_bypass_loss_and_a_loss_of_the_actors_own_is_refused(
        demo_dir, extra, named):
    bypass = {"algorithm.rollout_correction.bypass_mode": True}
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**bypass, **extra})))
    policy_loss = run.config.actor_rollout_ref.actor.policy_loss
    assert policy_loss.loss_mode == "bypass_mode"
    assert policy_loss.rollout_correction[named] == extra[f"algorithm.rollout_correction.{named}"]
    gspo = {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}
    with pytest.raises(AsyncConfigError) as refused:
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**bypass, **extra, **gspo})))
    assert "actor_rollout_ref.actor.policy_loss.loss_mode='gspo'" in str(refused.value)
    assert f"algorithm.rollout_correction.{named}=" in str(refused.value)
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**bypass, **gspo})))  # naive PPO: its own loss
    assert run.config.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"


def test_bypass_mode_alone_is_naive_ppo_with_no_recomputed_log_probs(demo_dir):
    bypass = {"algorithm.rollout_correction.bypass_mode": True}
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=bypass)))
    assert run.async_cfg.decoupled_ppo is False and run.proximal_logp_workers is None


LOGLINEAR = {"+algorithm.proximal_logp_method": "loglinear"}
UPDATE_FORWARD = {"+algorithm.proximal_logp_method": "update_forward"}


@pytest.mark.parametrize("method", [LOGLINEAR, UPDATE_FORWARD], ids=["loglinear", "update_forward"])
def test_a_proximal_policy_made_in_the_loss_runs_no_pi_prox_forward_and_trains_with_its_own_loss(demo_dir, method):
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config.actor import PolicyLossConfig

    from async_rl.core.decoupled_ppo import PROXIMAL_IN_LOSS

    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra=method)))
    assert run.async_cfg.decoupled_ppo is True and run.proximal_logp_workers is None  # no logp role, no forward
    policy_loss = omega_conf_to_dataclass(run.config.actor_rollout_ref.actor.policy_loss, PolicyLossConfig)
    assert policy_loss.loss_mode == PROXIMAL_IN_LOSS[method["+algorithm.proximal_logp_method"]]  # as verl reads it
    assert policy_loss.rollout_correction.rollout_is_threshold == "1e-30_5.0"
    assert read_run_config(compose_ppo(demo_overrides(demo_dir))).proximal_logp_workers == "train"


@pytest.mark.parametrize("extra,named,why", [
    ({"actor_rollout_ref.actor.ppo_epochs": 2}, "ppo_epochs=2", "1 with +algorithm.proximal_logp_method=update_forward"),
    ({"actor_rollout_ref.actor.ppo_mini_batch_size": 16}, "ppo_mini_batch_size=16", "at least data.train_batch_size"),
    ({"+algorithm.proximal_logp_workers": "logp"}, "proximal_logp_workers='logp'", "no pi_prox forward runs"),
    ({"+algorithm.decoupled_ppo": False}, "proximal_logp_method='update_forward'", "recompute without decoupled PPO"),
])
def test_the_update_forward_proximal_policy_where_the_weights_move_within_a_step_is_refused(demo_dir, extra, named,
                                                                                            why):
    with pytest.raises(AsyncConfigError, match="invalid config") as refused:
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**UPDATE_FORWARD, **extra})))
    assert named in str(refused.value) and why in str(refused.value)


@pytest.mark.parametrize("extra,named,why", [
    ({"+algorithm.decoupled_ppo": False}, "proximal_logp_method='loglinear'", "recompute without decoupled PPO"),
    ({"algorithm.rollout_correction.bypass_mode": True}, "proximal_logp_method='loglinear'",
     "recompute without decoupled PPO"),
    ({"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}, "loss_mode='gspo'", "vanilla with"),
    ({"+algorithm.proximal_logp_workers": "logp"}, "proximal_logp_workers='logp'", "no pi_prox forward runs"),
    ({"+algorithm.proximal_logp_method": "exact"}, "proximal_logp_method='exact'",
     "recompute or loglinear or update_forward"),
])
def test_the_loglinear_proximal_policy_beside_what_it_cannot_go_with_is_refused(demo_dir, extra, named, why):
    with pytest.raises(AsyncConfigError, match="invalid config") as refused:
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={**LOGLINEAR, **extra})))
    assert named in str(refused.value) and why in str(refused.value)


def test_dataloader_workers_left_at_verls_default_are_sized_to_the_work_and_a_named_value_stands(demo_dir,
                                                                                                 monkeypatch):
    from async_rl import run_config

    config = compose_ppo([o for o in demo_overrides(demo_dir) if not o.startswith("data.dataloader_num_workers=")])
    assert config.data.dataloader_num_workers == 8  # verl's default
    monkeypatch.setattr(run_config, "named_on_command_line", lambda key: False)
    run = read_run_config(config)
    assert run.config.data.dataloader_num_workers == run_config.SIZED_DATALOADER_WORKERS == 0
    assert not run.dataloader_workers_named
    for named in (True, None):  # named by the command, or a config composed in code: as given
        monkeypatch.setattr(run_config, "named_on_command_line", lambda key, named=named: named)
        run = read_run_config(config)
        assert run.config.data.dataloader_num_workers == 8 and run.dataloader_workers_named


def test_named_on_command_line_reads_hydras_overrides(demo_dir):
    from hydra.conf import HydraConf
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from async_rl.run_config import named_on_command_line

    assert named_on_command_line("data.dataloader_num_workers") is None  # no Hydra command running
    hydra = OmegaConf.create({"hydra": OmegaConf.structured(HydraConf)})
    hydra.hydra.overrides.task = ["data.dataloader_num_workers=2", "+trainer.x=1"]
    HydraConfig.instance().set_config(hydra)
    try:
        assert named_on_command_line("data.dataloader_num_workers") is True
        assert named_on_command_line("trainer.x") is True
        assert named_on_command_line("data.train_files") is False
    finally:
        HydraConfig.instance().cfg = None


def test_full_determinism_puts_verls_environment_in_every_process(demo_dir, monkeypatch):
    from async_rl.run_config import ray_init_kwargs

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    key = "actor_rollout_ref.rollout.full_determinism"
    run = read_run_config(compose_ppo(demo_overrides(demo_dir, extra={key: True})))
    env = ray_init_kwargs(run.config)["runtime_env"]["env_vars"]
    seed = str(run.config.actor_rollout_ref.rollout.seed)
    assert (env["VERL_FULL_DETERMINISM"], env["VLLM_BATCH_INVARIANT"], env["PYTHONHASHSEED"]) == ("1", "1", seed)
    plain = ray_init_kwargs(read_run_config(compose_ppo(demo_overrides(demo_dir))).config)["runtime_env"]["env_vars"]
    assert not {"VERL_FULL_DETERMINISM", "VLLM_BATCH_INVARIANT", "PYTHONHASHSEED"} & set(plain)
