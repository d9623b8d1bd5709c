"""verl's Ulysses sequence parallelism with sdpa attention (verl_patches/ulysses_sdpa.py): two gloo ranks,
each holding half of a packed sequence of two samples, compute what one process computes on the whole
sequence (logits and gradients); without the patch they do not (each rank attends within its half)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from verl_patches.ulysses_sdpa import packed_causal_mask

LENGTHS = (5, 7)  # two packed samples: 12 tokens, 6 a rank


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=64, tie_word_embeddings=True,
                         attn_implementation="sdpa", dtype="float32")
    return Qwen2ForCausalLM(config).float()


def packed_inputs():
    torch.manual_seed(1)
    input_ids = torch.randint(0, 32, (1, sum(LENGTHS)))
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return input_ids, position_ids


def forward_and_grads(model, input_ids, position_ids):
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits  # as verl calls it
    logits.square().sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def sp_rank(rank: int, port: int, patched: bool, out_dir: str) -> None:
    import torch.distributed as dist
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group

    from verl_patches.ulysses_sdpa import patch_ulysses_sdpa

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    set_ulysses_sequence_parallel_group(dist.new_group([0, 1]))
    if patched:
        patch_ulysses_sdpa()
    input_ids, position_ids = packed_inputs()
    half = input_ids.shape[1] // 2
    part = slice(rank * half, (rank + 1) * half)
    logits, grads = forward_and_grads(tiny_model(), input_ids[:, part], position_ids[:, part])
    for grad in grads.values():  # each rank's gradient is its half's: the sum is the whole sequence's
        dist.all_reduce(grad)
    torch.save({"logits": logits, "grads": grads}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def run_sp(patched: bool, out_dir) -> tuple[torch.Tensor, dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(sp_rank, args=(port, patched, str(out_dir)), nprocs=2, join=True)
    parts = [torch.load(out_dir / f"{rank}.pt") for rank in range(2)]
    return torch.cat([p["logits"] for p in parts], dim=1), parts[0]["grads"]


def test_two_sequence_parallel_ranks_compute_what_one_process_computes(tmp_path):
    expected_logits, expected_grads = forward_and_grads(tiny_model(), *packed_inputs())
    logits, grads = run_sp(True, tmp_path)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=1e-4, rtol=1e-4, msg=name)


def test_without_the_patch_each_rank_attends_within_its_half(tmp_path):
    expected_logits, _ = forward_and_grads(tiny_model(), *packed_inputs())
    logits, _ = run_sp(False, tmp_path)
    assert not torch.allclose(logits, expected_logits, atol=1e-3)


def test_the_mask_keeps_each_packed_sample_to_itself():
    mask = packed_causal_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    assert mask.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                             [True, True, True, False, False], [False, False, False, True, False],
                             [False, False, False, True, True]]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
