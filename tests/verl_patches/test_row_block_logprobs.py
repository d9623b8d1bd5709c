"""verl's log-probs of labels a block of rows at a time (verl_patches/row_block_logprobs.py): the values and
gradients of verl's row-at-a-time `logprobs_from_logits_v2`, for packed (tokens, vocab) and padded
(batch, seq, vocab) logits, in float32 and bfloat16, with blocks smaller than the input."""

from __future__ import annotations

import pytest
import torch
from verl.utils import torch_functional

from verl_patches import row_block_logprobs
from verl_patches.row_block_logprobs import logprobs_in_row_blocks, patch_row_block_logprobs

VERLS = torch_functional.logprobs_from_logits_v2


@pytest.mark.parametrize("shape", [(37, 16), (3, 11, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_elements", [1 << 24, 40])  # one block; blocks of 2 rows
def test_the_same_values_and_gradients_as_verls_row_loop(shape, dtype, block_elements, monkeypatch):
    monkeypatch.setattr(row_block_logprobs, "ROW_BLOCK_ELEMENTS", block_elements)
    torch.manual_seed(0)
    logits = (3 * torch.randn(shape)).to(dtype).requires_grad_()
    labels = torch.randint(0, shape[-1], shape[:-1])
    results = []
    for function in (VERLS, logprobs_in_row_blocks):
        values = function(logits, labels)
        (grad,) = torch.autograd.grad(values.float().square().sum(), logits)
        results.append((values, grad))
    (want, want_grad), (got, got_grad) = results
    assert got.shape == want.shape == labels.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def test_a_wrong_label_would_show():
    """The comparison above can fail: the log-prob of another label differs."""
    torch.manual_seed(0)
    logits, labels = torch.randn(37, 16), torch.randint(0, 16, (37,))
    assert not torch.allclose(logprobs_in_row_blocks(logits, (labels + 1) % 16), VERLS(logits, labels))


def test_the_patch_routes_verls_logprobs_through_the_blocks(monkeypatch):
    monkeypatch.setattr(torch_functional, "logprobs_from_logits_v2", VERLS)
    patch_row_block_logprobs()
    patch_row_block_logprobs()  # idempotent
    assert torch_functional.logprobs_from_logits_v2 is logprobs_in_row_blocks
    calls = []
    monkeypatch.setattr(row_block_logprobs.torch, "logsumexp", lambda *a, **k: calls.append(1) or torch.special.logsumexp(*a, **k))
    torch_functional.logprobs_from_logits(torch.randn(50, 16), torch.randint(0, 16, (50,)))
    assert len(calls) == 1  # one block, not one call per row
