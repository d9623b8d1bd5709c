"""verl_patches/weights_only_checkpoint_load.py: verl's FSDP checkpoint manager loads tensors and plain data
only; the RNG states verl saves still load; a file that would unpickle an object is refused."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch


class Payload:
    """An object a pickle builds by running code of the file's choosing."""


def test_verls_checkpoint_manager_loads_weights_only(tmp_path, monkeypatch):
    import verl.utils.checkpoint.fsdp_checkpoint_manager as manager_module

    from verl_patches.weights_only_checkpoint_load import patch_weights_only_checkpoint_load

    monkeypatch.setattr(manager_module, "torch", torch)  # undone after the test
    tampered = tmp_path / "extra_state_world_size_1_rank_0.pt"
    torch.save({"lr_scheduler": {"last_epoch": 3}, "payload": Payload()}, tampered)
    assert isinstance(manager_module.torch.load(tampered, weights_only=False)["payload"], Payload)  # verl's load
    patch_weights_only_checkpoint_load()
    patch_weights_only_checkpoint_load()  # idempotent
    with pytest.raises(pickle.UnpicklingError, match="Payload"):
        manager_module.torch.load(tampered, weights_only=False)  # as verl calls it
    # what verl's extra_state holds: the lr scheduler's state and the RNG states of torch, numpy and Python
    extra = tmp_path / "extra.pt"
    rng = {"cpu": torch.get_rng_state(), "numpy": np.random.get_state(), "random": random.getstate()}
    torch.save({"lr_scheduler": {"base_lrs": [1e-3], "last_epoch": 3, "_step_count": 4}, "rng": rng}, extra)
    loaded = manager_module.torch.load(extra, weights_only=False)
    assert torch.equal(loaded["rng"]["cpu"], rng["cpu"]) and loaded["rng"]["random"] == rng["random"]
    assert loaded["rng"]["numpy"][0] == "MT19937" and np.array_equal(loaded["rng"]["numpy"][1], rng["numpy"][1])
    assert manager_module.torch.save is torch.save  # every other name is torch's
