"""verl's checkpoint hooks under the flag (async_rl/checkpoints.py): `trainer.esi_redundant_time` saves
early when the machine's capacity block (ESI) is about to expire, by verl's `should_save_ckpt_esi`;
`trainer.checkpoint_callback_class` is verl's `CheckpointCallback`, called once a checkpoint is committed."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest
from omegaconf import OmegaConf

from async_rl.checkpoint_dir import CheckpointDir
from async_rl.checkpoints import RunCheckpointer, read_checkpoint_config
from async_rl.core.errors import AsyncConfigError

ESI_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"  # verl's (vemlp)


def trainer_config(tmp_path, **trainer):
    return OmegaConf.create({"trainer": {"save_freq": 5, "default_local_dir": str(tmp_path / "ckpt"), **trainer}})


def test_a_save_comes_early_when_the_capacity_block_expires_within_a_step_a_save_and_the_margin(tmp_path,
                                                                                                monkeypatch):
    cfg = read_checkpoint_config(trainer_config(tmp_path, esi_redundant_time=30))
    assert not cfg.due(3, total_steps=10, max_step_s=20.0)  # no capacity block: verl's rule alone
    monkeypatch.setenv(ESI_ENV, str(time.time() + 100))  # expires in 100 s: a save (60) + a step (20) + 30 > 100
    assert cfg.due(3, total_steps=10, max_step_s=20.0)
    assert not cfg.due(3, total_steps=10, max_step_s=0.0)  # verl's rule: no step measured yet, no early save
    no_margin = read_checkpoint_config(trainer_config(tmp_path))  # 60 + 20 + 0 < 100
    assert not no_margin.due(3, total_steps=10, max_step_s=20.0)
    off = read_checkpoint_config(trainer_config(tmp_path, save_freq=-1, esi_redundant_time=30))
    assert not off.due(3, total_steps=10, max_step_s=20.0)  # no checkpoints at all: none early either
    with pytest.raises(AsyncConfigError, match="trainer.esi_redundant_time=-1"):
        read_checkpoint_config(trainer_config(tmp_path, esi_redundant_time=-1))


CALLBACK = '''
from verl.trainer.ppo.checkpoint_callback import CheckpointCallback

CALLS = []


class Recorder(CheckpointCallback):
    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        CALLS.append((trainer, global_step, checkpoint_dir, async_save, sorted(__import__("os").listdir(checkpoint_dir)),
                      self.config.trainer.save_freq))
'''


def test_the_checkpoint_callback_runs_once_the_checkpoint_is_committed(tmp_path, monkeypatch):
    (tmp_path / "hooks.py").write_text(CALLBACK)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = trainer_config(tmp_path, checkpoint_callback_class="hooks.Recorder")
    cfg = read_checkpoint_config(config)

    class Remote:
        def __init__(self, fn):
            self.remote = fn

    class Dataloader:
        def __init__(self):
            self.state_before = Remote(self._state)

        async def _state(self, index):
            return {"_num_yielded": index}

    class Ranks:
        def snapshot_checkpoint(self, path, step):
            self.path = path
            return [{"snapshot_s": 0.01}]

        def wait_checkpoint_written(self, timeout_s):
            os.makedirs(self.path)
            return [{"write_s": 0.1, "bytes": 1.0}]

    async def main():
        saver = RunCheckpointer(cfg, total_steps=5, dataloader=Dataloader(), config=config)
        await saver.save(5, Ranks())
        return await saver.wait()

    assert asyncio.run(main()) == 5
    step_dir = str(tmp_path / "ckpt" / "global_step_5")
    # after the commit: the final directory, every file in it, the tracker naming it
    assert sys.modules["hooks"].CALLS == [(None, 5, step_dir, False, ["actor", "async_rl_state.pt", "data.pt"], 5)]
    assert CheckpointDir(cfg.root).tracked_step() == 5
    with pytest.raises(AsyncConfigError, match="trainer.checkpoint_callback_class='hooks.NoSuch'"):
        read_checkpoint_config(trainer_config(tmp_path, checkpoint_callback_class="hooks.NoSuch"))
