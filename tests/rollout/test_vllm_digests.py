"""Reading a vLLM replica's weights under the trainer's names (async_rl/rollout/vllm_digests.py), without
vLLM: a stand-in model laid out as vLLM's Qwen2 is (fused qkv / gate_up, padded vocabulary, tied
head). The real read runs in tests/e2e/test_vllm_cpu_e2e.py."""

from __future__ import annotations

import pytest
import torch

from async_rl.rollout.vllm_digests import (
    ALLOW_PICKLE_ENV,
    server_weight_digests,
    unfused_named_tensors,
    worker_weight_digests,
)
from param_update.buckets import tensor_digest


class Fused(torch.nn.Module):
    def __init__(self, sizes, cols):
        super().__init__()
        self.output_partition_sizes = sizes
        self.weight = torch.nn.Parameter(torch.randn(sum(sizes), cols))
        self.bias = torch.nn.Parameter(torch.randn(sum(sizes)))


class PaddedEmbedding(torch.nn.Module):
    def __init__(self, vocab, padded, dim):
        super().__init__()
        self.org_vocab_size = vocab
        self.weight = torch.nn.Parameter(torch.randn(padded, dim))


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.qkv_proj = Fused([8, 4, 4], 6)
        self.self_attn.o_proj = torch.nn.Linear(8, 6, bias=False)
        self.mlp = torch.nn.Module()
        self.mlp.gate_up_proj = Fused([5, 5], 6)


class VllmLikeModel(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = PaddedEmbedding(vocab=13, padded=64, dim=6)
        self.model.layers = torch.nn.ModuleList([Layer()])
        self.lm_head = self.model.embed_tokens  # tied: one parameter


def test_fused_projections_are_split_back_to_the_trainers_tensors():
    model = VllmLikeModel()
    tensors = dict(unfused_named_tensors(model))
    qkv = model.model.layers[0].self_attn.qkv_proj
    gate_up = model.model.layers[0].mlp.gate_up_proj
    prefix = "model.layers.0"
    assert torch.equal(tensors[f"{prefix}.self_attn.q_proj.weight"], qkv.weight[:8])
    assert torch.equal(tensors[f"{prefix}.self_attn.k_proj.weight"], qkv.weight[8:12])
    assert torch.equal(tensors[f"{prefix}.self_attn.v_proj.bias"], qkv.bias[12:])
    assert torch.equal(tensors[f"{prefix}.mlp.up_proj.weight"], gate_up.weight[5:])
    assert torch.equal(tensors[f"{prefix}.self_attn.o_proj.weight"], model.model.layers[0].self_attn.o_proj.weight)
    # the padded vocabulary rows are dropped; the tied head appears once, as the embedding
    assert tensors["model.embed_tokens.weight"].shape == (13, 6)
    assert "lm_head.weight" not in tensors
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in tensors)


def test_worker_digests_equal_the_digests_of_the_unfused_trainer_tensors():
    model = VllmLikeModel()
    worker = type("Worker", (), {"model_runner": type("Runner", (), {"model": model})()})()
    digests = worker_weight_digests(worker)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight.detach().clone()
    assert digests["model.layers.0.self_attn.k_proj.weight"] == tensor_digest(qkv[8:12].clone())
    qkv[9, 0] += 1e-6  # a one-element change in the trainer's k_proj shows
    assert digests["model.layers.0.self_attn.k_proj.weight"] != tensor_digest(qkv[8:12].clone())


def test_server_digests_need_the_pickle_variable_and_skip_servers_without_an_engine(monkeypatch):
    monkeypatch.delenv(ALLOW_PICKLE_ENV, raising=False)
    assert server_weight_digests(type("Follower", (), {"engine": None})()) is None  # node rank > 0
    with pytest.raises(RuntimeError, match=ALLOW_PICKLE_ENV):
        server_weight_digests(type("Server", (), {"engine": object()})())
