"""LoRA over the weight sync (param_update/lora.py): the adapter's tensors travel, a CPU rollout server
serves them merged onto the base it loaded, bit for bit what PEFT's own merge gives; verl's own trainer's
way (`update_adapter`, the CPU backend under verl's trainer) serves the same."""

from __future__ import annotations

import sys
import time

import pytest
import ray
import torch
from peft import LoraConfig, TaskType, get_peft_model
from peft.utils.save_and_load import get_peft_model_state_dict

from async_rl.core.messages import NewWeights
from param_update.lora import (
    LoraError,
    adapter_from_peft_config,
    adapter_of,
    merge_linear,
    served_state,
)
from sync_actors import TIMEOUT_S, digests, start_server, start_stage, tiny_model, wait_for_timings

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_model(seed: int, **config):
    """The tiny model of sync_actors (base seed 0) with a LoRA adapter whose B is random (PEFT starts it at
    0, which would merge to the base and prove nothing)."""
    settings = dict(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules=TARGETS, bias="none")
    model = get_peft_model(tiny_model(0), LoraConfig(**{**settings, **config}))
    randomize_adapter(model, seed)
    return model


def randomize_adapter(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def merged_by_peft(model) -> dict[str, torch.Tensor]:
    """PEFT's own merge of a copy of `model`: the weights a server must serve."""
    import copy

    return copy.deepcopy(model).merge_and_unload().state_dict()


@pytest.mark.parametrize("rslora", [False, True])
def test_the_merge_is_pefts_bit_for_bit(rslora):
    model = lora_model(1, use_rslora=rslora)
    adapter = adapter_of(model)
    assert sorted(layer.weight for layer in adapter.layers) == sorted(
        f"model.layers.{i}.{part}.{proj}.weight" for i in range(2)
        for part, proj in [("self_attn", "q_proj"), ("self_attn", "v_proj"), ("mlp", "down_proj")])
    assert {layer.scaling for layer in adapter.layers} == {8 / 4 ** 0.5 if rslora else 8 / 4}
    want = merged_by_peft(model)
    served = served_state(model.state_dict().items(), adapter)
    assert served.keys() == want.keys()
    assert all(torch.equal(served[name], want[name]) for name in want)
    # what verl's trainer sends a rollout (peft config + adapter tensors) describes the same merge
    sent = get_peft_model_state_dict(model)
    assert set(sent) == set(adapter.sent_names)
    assert adapter_from_peft_config(model.peft_config["default"].to_dict(), sent) == adapter
    # what a backend serving adapters itself (vLLM) is given with each version: PEFT's own config
    assert adapter.peft_config == model.peft_config["default"].to_dict()
    assert adapter.peft_config["use_rslora"] is rslora


def test_the_merge_changes_the_adapted_weights_only():
    model = lora_model(2)
    base = tiny_model(0).state_dict()
    served = served_state(model.state_dict().items(), adapter_of(model))
    changed = {name for name in base if not torch.equal(base[name], served[name])}
    assert changed == set(adapter_of(model).weights)


def test_adapters_the_sync_cannot_merge_are_named():
    with pytest.raises(LoraError, match="DoRA"):
        adapter_of(lora_model(1, use_dora=True))
    with pytest.raises(LoraError, match="embed_tokens.*Linear layers only"):
        adapter_of(lora_model(1, target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(LoraError, match="rank_pattern"):
        adapter_from_peft_config({"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 8}}, [])
    with pytest.raises(LoraError, match="do not fit"):
        merge_linear(torch.zeros(4, 6), torch.zeros(2, 5), torch.zeros(4, 2), 1.0)


@ray.remote
class LoraTrainer:
    """A PEFT model sent the way a LoRA train rank sends it: its adapter's tensors alone."""

    def __init__(self, seed: int):
        from param_update.sender import BucketSender

        self.model = lora_model(seed)
        self.sender = BucketSender()

    def adapter(self):
        return adapter_of(self.model)

    def layout(self) -> dict:
        return {name: (t.dtype, tuple(t.shape)) for name, t in get_peft_model_state_dict(self.model).items()}

    def send(self, version: int, bucket_bytes: int, sink) -> dict:
        tensors = get_peft_model_state_dict(self.model)
        return self.sender.gather_and_send(tensors.items(), version, bucket_bytes, sink, True, frozenset())

    def served_digests(self) -> dict:
        return digests(merged_by_peft(self.model))

    def train(self, seed: int) -> None:
        randomize_adapter(self.model, seed)

    def verl_update(self):
        """(adapter tensors, peft config dict): what verl's engine worker gives a rollout's update_weights."""
        return list(get_peft_model_state_dict(self.model).items()), self.model.peft_config["default"].to_dict()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora_base")
    tiny_model(0).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("dual", [True, False])
def test_a_server_serves_each_synced_adapter_merged_onto_its_base(small_objects_ray, model_dir, dual):
    trainer = LoraTrainer.remote(seed=1)
    adapter, layout = ray.get([trainer.adapter.remote(), trainer.layout.remote()], timeout=TIMEOUT_S)
    server = start_server(model_dir, dual, configure=False)
    base = ray.get(server.weight_digests.remote(), timeout=TIMEOUT_S)
    ray.get(server.configure_weight_sync.remote(dual, 4096, layout, True, adapter), timeout=TIMEOUT_S)
    stage = start_stage([server])
    sizes = []
    for version, seed in [(1, 1), (2, 7)]:
        ray.get(trainer.train.remote(seed), timeout=TIMEOUT_S)
        ray.get(stage.put.remote(NewWeights(version, time.time())), timeout=TIMEOUT_S)
        ray.get(trainer.send.remote(version, 2048, stage), timeout=TIMEOUT_S)
        sizes.append(wait_for_timings(stage, version))
        served = ray.get(server.weight_digests.remote(), timeout=TIMEOUT_S)
        assert served == ray.get(trainer.served_digests.remote(), timeout=TIMEOUT_S)
        assert served != base  # and the next version serves something else again
        base = served
        assert ray.get(server.get_param_version.remote(), timeout=TIMEOUT_S) == version
    adapter_bytes = sum(torch.empty(shape, dtype=dtype).nbytes for dtype, shape in layout.values())
    assert [s["async/param_update/bytes"] for s in sizes] == [adapter_bytes, adapter_bytes]
    # it still generates, from the merged weights
    out = ray.get(server.generate.remote(prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 4}, request_id="r"),
                  timeout=TIMEOUT_S)
    assert len(out.token_ids) == 4


def test_verl_trainers_adapter_update_serves_the_same_merge(small_objects_ray, model_dir):
    """The CPU backend under verl's own trainer: `update_adapter` (what `CPUServerAdapter` forwards when verl
    sends `peft_config`), twice with different adapters: each time PEFT's merge onto the loaded base."""
    trainer = LoraTrainer.remote(seed=3)
    server = start_server(model_dir, dual=False, configure=False)
    for version, seed in [(1, 3), (2, 4)]:
        ray.get(trainer.train.remote(seed), timeout=TIMEOUT_S)
        tensors, peft_config = ray.get(trainer.verl_update.remote(), timeout=TIMEOUT_S)
        ray.get(server.update_adapter.remote(tensors, peft_config, version), timeout=TIMEOUT_S)
        assert ray.get(server.weight_digests.remote(), timeout=TIMEOUT_S) == ray.get(
            trainer.served_digests.remote(), timeout=TIMEOUT_S)
