"""sdpa on a packed sequence attends within each sample (verl_patches/packed_sdpa.py): the same output and
gradients as transformers' block-diagonal mask over the whole sequence, computed as a padded batch of
the samples (never an S x S attention); anything that is not a packed sequence goes to transformers'
function unchanged."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from verl_patches.packed_sdpa import packed_layout, packed_sdpa, patch_packed_sdpa
from verl_patches.ulysses_sdpa import packed_causal_mask

LENGTHS = (5, 1, 9, 3)  # a one-token sample and uneven lengths


class Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2  # 4 query heads, 2 key / value heads: transformers repeats them


def packed_qkv(lengths=LENGTHS):
    torch.manual_seed(0)
    total = sum(lengths)
    query = torch.randn(1, 4, total, 8, requires_grad=True)
    key, value = (torch.randn(1, 2, total, 8, requires_grad=True) for _ in range(2))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return query, key, value, position_ids


class Recorder:
    """transformers' sdpa function, recording the query shape and mask of each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, *args, **kwargs):
        self.calls.append((tuple(query.shape), attention_mask))
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def output_and_grads(attention, query, key, value, mask, position_ids):
    output, _ = attention(Module(), query, key, value, mask, position_ids=position_ids, scaling=8 ** -0.5)
    output.square().sum().backward()
    grads = [t.grad.clone() for t in (query, key, value)]
    for t in (query, key, value):
        t.grad = None
    return output.detach(), grads


def test_a_packed_sequence_gets_the_block_diagonal_masks_result_from_a_padded_batch():
    query, key, value, position_ids = packed_qkv()
    expected, expected_grads = output_and_grads(sdpa_attention_forward, query, key, value,
                                                packed_causal_mask(position_ids), position_ids)
    recorder = Recorder()
    output, grads = output_and_grads(packed_sdpa(recorder), query, key, value,
                                     packed_causal_mask(position_ids), position_ids)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=1e-5)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)
    # one call on the samples laid out as a batch, causal without a mask: never the S x S attention
    assert recorder.calls == [((len(LENGTHS), 4, max(LENGTHS), 8), None)]


def test_attending_across_samples_would_differ():
    """The comparison above can fail: a plain causal attention over the packed sequence differs."""
    query, key, value, position_ids = packed_qkv()
    expected, _ = output_and_grads(sdpa_attention_forward, query, key, value,
                                   packed_causal_mask(position_ids), position_ids)
    across, _ = output_and_grads(sdpa_attention_forward, query, key, value, None, position_ids)
    assert not torch.allclose(across, expected, atol=1e-3)


@pytest.mark.parametrize("case", ["one sample", "a batch of rows", "decoding with a cache", "no position ids"])
def test_anything_but_a_packed_sequence_is_transformers_function_unchanged(case):
    torch.manual_seed(0)
    rows, length = (2, 6) if case == "a batch of rows" else (1, 6)
    query = torch.randn(rows, 4, 1 if case == "decoding with a cache" else length, 8)
    key, value = (torch.randn(rows, 2, length, 8) for _ in range(2))
    position_ids = {"one sample": torch.arange(length)[None], "a batch of rows": torch.arange(length).repeat(2, 1),
                    "decoding with a cache": torch.tensor([[length - 1]]), "no position ids": None}[case]
    recorder = Recorder()
    packed_sdpa(recorder)(Module(), query, key, value, None, position_ids=position_ids)
    assert recorder.calls == [(tuple(query.shape), None)]


@pytest.mark.parametrize("positions", [[0, 1, 2, 0, 0, 1], [3, 4, 5, 0, 1, 2], [0, 1, 2, 7, 8], [5, 6, 7, 8]])
def test_the_layout_splits_samples_where_transformers_mask_does(positions):
    from transformers.masking_utils import find_packed_sequence_indices

    position_ids = torch.tensor([positions])
    layout = packed_layout(position_ids, len(positions))
    sequence = find_packed_sequence_indices(position_ids)
    if sequence is None:
        assert layout is None
        return
    sample = sequence[0]  # each token's sample; its offset is how many tokens of that sample come before it
    assert layout.samples == int(sample.max()) + 1
    assert layout.flat_index.tolist() == [int(sample[i]) * layout.longest + int((sample[:i] == sample[i]).sum())
                                          for i in range(len(positions))]


def test_a_patched_model_on_packed_samples_computes_what_it_computes_on_each_sample(monkeypatch):
    import transformers.masking_utils as masking_utils
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32, max_position_embeddings=64,
                         attn_implementation="sdpa", dtype="float32")
    model = Qwen2ForCausalLM(config).float()
    samples = [torch.randint(0, 32, (1, n)) for n in LENGTHS]
    expected = torch.cat([model(input_ids=s, use_cache=False).logits for s in samples], dim=1)

    # transformers' own function, spied on, then the patch (restored after the test)
    recorder = Recorder()
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", recorder)
    monkeypatch.setattr(masking_utils, "_preprocess_mask_arguments", masking_utils._preprocess_mask_arguments)
    patch_packed_sdpa()
    masks = []
    patched = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", functools.wraps(patched)(
        lambda module, q, k, v, mask, *a, **kw: masks.append(mask) or patched(module, q, k, v, mask, *a, **kw)))
    logits = model(input_ids=torch.cat(samples, dim=1), position_ids=packed_qkv()[3], use_cache=False).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert masks == [None, None]  # no S x S mask was built for either layer
    assert [shape for shape, _ in recorder.calls] == [(len(LENGTHS), 2, max(LENGTHS), 32)] * 2  # samples as a batch
