"""The plugin entry point and the CPU patches: each check fails without the patch it covers."""

from __future__ import annotations

import inspect

import pytest
import torch
from omegaconf import OmegaConf


def test_import_verl_loads_the_plugin_wrappers():
    import verl  # noqa: F401
    import verl.utils.config as config_module
    import verl.utils.device as device_module

    assert getattr(config_module.validate_config, "_async_rl_wrapped", False)
    assert getattr(device_module.auto_set_device, "_async_rl_wrapped", False)


def test_without_the_flag_validate_config_is_verls(monkeypatch):
    import verl.utils.config as config_module

    calls = []
    original = config_module.validate_config.__wrapped__
    monkeypatch.setattr(config_module.validate_config, "__wrapped__", original)
    cfg = OmegaConf.create({"actor_rollout_ref": {"rollout": {}}})
    wrapper = config_module.validate_config
    # the wrapper closes over verl's function: same outcome as calling verl directly
    with pytest.raises(Exception) as direct:
        original(config=cfg, use_reference_policy=False, use_critic=False)
    with pytest.raises(Exception) as wrapped:
        wrapper(config=cfg, use_reference_policy=False, use_critic=False)
    assert type(direct.value) is type(wrapped.value) and str(direct.value) == str(wrapped.value)
    assert not calls


def test_with_the_flag_validate_config_points_main_ppos_run_ppo_at_the_pipeline(demo_dir, monkeypatch):
    """Under `python -m verl.trainer.main_ppo` (main_ppo is `__main__`) the run is read once and main_ppo's
    `run_ppo` runs the pipeline on it; from a script that is not main_ppo the error says what to call."""
    import sys
    import types

    from async_rl.demo import demo_overrides
    from async_rl.plugin import enter_async_pipeline
    from async_rl.run_config import RunConfig
    from helpers.lineage import compose_ppo

    cfg = compose_ppo(demo_overrides(demo_dir))
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="verl.trainer.main_ppo")
    main.run_ppo = object()
    monkeypatch.setitem(sys.modules, "__main__", main)
    runs = []
    monkeypatch.setattr("async_rl.pipeline.run_async_pipeline", lambda run, runner=None: runs.append((run, runner)))
    enter_async_pipeline(cfg)
    main.run_ppo(cfg, task_runner_class="verl's runner")  # what main_ppo's main() calls next
    ((run, runner),) = runs
    assert isinstance(run, RunConfig) and run.total_steps > 0 and runner == "verl's runner"

    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    with pytest.raises(RuntimeError, match="call async_rl.pipeline.run_async_pipeline"):
        enter_async_pipeline(cfg)


@pytest.mark.parametrize("value,enters", [(1, True), ("yes", True), ("ON", True), (True, True), (0, False),
                                          ("off", False), ("No", False), (False, False)])
def test_the_flag_as_hydra_reads_it_picks_the_pipeline_or_verl(monkeypatch, value, enters):
    """`+actor_rollout_ref.async_pipeline=1` reaches the plugin as the int 1 (`yes` / `on` as strings): the
    pipeline; 0 / no / off: verl's own validate_config, as without the key."""
    import verl.utils.config as config_module

    calls = []
    monkeypatch.setattr("async_rl.plugin.enter_async_pipeline", lambda config: calls.append("pipeline"))
    cfg = OmegaConf.create({"actor_rollout_ref": {"async_pipeline": value, "rollout": {}}, "trainer": {}})
    with pytest.raises(Exception, match="trainer.n_gpus_per_node"):  # verl's own check, on this bare config
        config_module.validate_config(config=cfg, use_reference_policy=False, use_critic=False)
    calls.append("verl")
    assert calls == (["pipeline", "verl"] if enters else ["verl"])


@pytest.mark.parametrize("value", [2, "maybe", 1.5, None])
def test_any_other_flag_value_stops_the_command_before_verl_runs(monkeypatch, value):
    import verl.utils.config as config_module
    import verl.utils.device as device_module

    from async_rl.core.errors import AsyncConfigError

    monkeypatch.setattr("async_rl.plugin.enter_async_pipeline", lambda config: pytest.fail("entered the pipeline"))
    cfg = OmegaConf.create({"actor_rollout_ref": {"async_pipeline": value, "rollout": {}}, "trainer": {"device": "cpu"}})
    for check in (device_module.auto_set_device, lambda c: config_module.validate_config(c, False, False)):
        with pytest.raises(AsyncConfigError, match="actor_rollout_ref.async_pipeline=.*true or false"):
            check(cfg)


def test_auto_set_device_keeps_cpu_only_with_the_flag():
    import verl.utils.device as device_module

    plain = OmegaConf.create({"trainer": {"device": "cpu"}})
    device_module.auto_set_device(plain)
    expected = device_module.auto_set_device.__wrapped__
    reference = OmegaConf.create({"trainer": {"device": "cpu"}})
    expected(reference)
    assert plain.trainer.device == reference.trainer.device  # verl's own behaviour, untouched
    flagged = OmegaConf.create({"trainer": {"device": "cpu"}, "actor_rollout_ref": {"async_pipeline": True}})
    device_module.auto_set_device(flagged)
    assert flagged.trainer.device == "cpu"


def test_cpu_platform_is_registered_but_never_autodetected():
    from verl.plugin.platform import PlatformRegistry

    platform_cls = PlatformRegistry.get("cpu")
    assert platform_cls is not None
    platform = platform_cls()
    assert platform.is_platform_available(use_smi_check=True) is False
    assert platform.device_name == "cpu"
    assert platform.communication_backend_name() == "gloo"
    assert platform.ray_resource_name() == "CPU"
    assert platform.ray_resource_options(1) == {}
    # verl passes current_device() to .to(): an int would mean an accelerator
    assert torch.zeros(1).to(platform.current_device()).device.type == "cpu"


def test_gloo_patch_passes_plain_gloo(monkeypatch):
    import verl.utils.distributed as dist_utils
    import verl.workers.engine_workers as engine_workers

    from verl_patches import cpu_patches

    seen = []
    monkeypatch.setattr(dist_utils, "initialize_global_process_group_ray", lambda timeout_second=None, backend=None: seen.append(backend))
    monkeypatch.setattr(engine_workers, "initialize_global_process_group_ray", dist_utils.initialize_global_process_group_ray)
    monkeypatch.setattr(cpu_patches, "_APPLIED", set())
    engine_workers.initialize_global_process_group_ray(timeout_second=None)
    assert seen == [None]  # verl alone: backend chosen from the platform (cpu:gloo,cpu:gloo)
    cpu_patches.patch_gloo_process_group()
    engine_workers.initialize_global_process_group_ray(timeout_second=None)
    assert seen[-1] == "gloo"


def test_unpinned_offload_patch(monkeypatch):
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl

    from verl_patches import cpu_patches

    monkeypatch.setattr(cpu_patches, "_APPLIED", set())
    # verl's own, even where an earlier test of this process applied the patch (verl's trainer set up on CPU)
    monkeypatch.setattr(fsdp_impl, "CPUOffloadPolicy", inspect.unwrap(fsdp_impl.CPUOffloadPolicy))
    assert fsdp_impl.CPUOffloadPolicy(pin_memory=True).pin_memory is True
    cpu_patches.patch_unpinned_cpu_offload()
    assert fsdp_impl.CPUOffloadPolicy(pin_memory=True).pin_memory is False


def test_value_model_patch_loads_verls_critic_with_the_configured_attention(monkeypatch, demo_dir):
    """verl loads its critic's value model with flash_attention_2 hard-coded, which fails on CPU; the
    patch loads it with the attention the critic's config names (sdpa by default)."""
    import verl.utils.model as model_utils
    from transformers import AutoConfig

    from verl_patches import cpu_patches

    monkeypatch.setattr(cpu_patches, "_APPLIED", set())
    monkeypatch.setattr(model_utils, "load_valuehead_model", inspect.unwrap(model_utils.load_valuehead_model))
    path = str(demo_dir / "model")

    def config(attention=None):
        hf_config = AutoConfig.from_pretrained(path, num_labels=1, **({"attn_implementation": attention} if attention else {}))
        return hf_config

    with pytest.raises(RuntimeError, match="not a value head model"):  # verl alone, on this machine
        model_utils.load_valuehead_model(path, torch.float32, config(), False)
    cpu_patches.patch_value_model_attention()
    for asked, used in ((None, "sdpa"), ("eager", "eager"), ("flash_attention_2", "sdpa")):
        model = model_utils.load_valuehead_model(path, torch.float32, config(asked), False)
        assert type(model).__name__ == "Qwen2ForTokenClassification" and model.config._attn_implementation == used
        assert model.score.out_features == 1  # one value per token
