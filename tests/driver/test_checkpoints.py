"""Checkpoints on disk (async_rl/checkpoints.py): verl's keys checked at start, atomic commits,
rotation, the resume point verl's rules pick, and what a resume needs to lose nothing."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from async_rl.checkpoint_dir import DATA_FILE, TRACKER_FILE, CheckpointDir
from async_rl.checkpoints import (
    STATE_FILE,
    RunState,
    dataloader_workers_in_state,
    find_resume_point,
    read_checkpoint_config,
)
from async_rl.core.errors import AsyncConfigError
from async_rl.core.fault_points import HOLD_AT_ENV, HOLD_DIR_ENV
from helpers.engine_workers import run_on_workers


def trainer_config(tmp_path, **trainer):
    base = {"save_freq": 2, "default_local_dir": str(tmp_path / "ckpt"), "resume_mode": "auto",
            "resume_from_path": None, "default_hdfs_dir": None, "del_local_ckpt_after_load": False}
    return OmegaConf.create({"trainer": {**base, **trainer}})


def fake_checkpoint(root, step, world_size=1, state=True, dataloader_state=None, commit=True):
    """A checkpoint directory with verl's metadata (no weights: these tests never load them)."""
    directory = CheckpointDir(str(root))
    partial = directory.begin(step)
    os.makedirs(os.path.join(partial, "actor"))
    with open(os.path.join(partial, "actor", "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": world_size}, f)
    torch.save(dataloader_state if dataloader_state is not None else {"_num_yielded": step}, os.path.join(partial, DATA_FILE))
    if state:
        torch.save(vars(RunState(step, step + 1, {"_num_yielded": step}, 0.25, None)), os.path.join(partial, STATE_FILE))
    return directory.commit(step) if commit else partial


@pytest.mark.parametrize("key,value,named", [
    ("save_freq", "often", "trainer.save_freq"),
    ("max_critic_ckpt_to_keep", 2, "trainer.max_critic_ckpt_to_keep"),  # actor's: null (keep all)
    ("resume_mode", "latest", "trainer.resume_mode"),
    ("max_actor_ckpt_to_keep", 0, "trainer.max_actor_ckpt_to_keep"),
    ("default_local_dir", None, "trainer.default_local_dir"),
])
def test_a_checkpoint_key_that_cannot_work_is_named(tmp_path, key, value, named):
    with pytest.raises(AsyncConfigError, match=f"invalid config: {named}="):
        read_checkpoint_config(trainer_config(tmp_path, **{key: value}))


def test_resume_path_must_name_an_existing_global_step_dir(tmp_path):
    for path in (str(tmp_path / "somewhere"), str(tmp_path / "global_step_3")):
        with pytest.raises(AsyncConfigError, match="trainer.resume_from_path="):
            read_checkpoint_config(trainer_config(tmp_path, resume_mode="resume_path", resume_from_path=path))
    done = fake_checkpoint(tmp_path / "ckpt", 3)
    cfg = read_checkpoint_config(trainer_config(tmp_path, resume_mode="resume_path", resume_from_path=done))
    assert cfg.resume_from_path == done
    os.remove(os.path.join(done, DATA_FILE))  # a copy cut short
    with pytest.raises(AsyncConfigError, match=f"trainer.resume_from_path=.*a complete checkpoint: it is incomplete "
                                               f"\\(no {DATA_FILE}\\)"):
        read_checkpoint_config(trainer_config(tmp_path, resume_mode="resume_path", resume_from_path=done))


def test_save_contents_are_verls_names():
    bad = OmegaConf.create({"trainer": {"default_local_dir": "x"},
                            "actor_rollout_ref": {"actor": {"checkpoint": {"save_contents": ["model", "weights"]}}}})
    with pytest.raises(AsyncConfigError, match="actor_rollout_ref.actor.checkpoint.save_contents"):
        read_checkpoint_config(bad)


def test_saves_follow_verls_rule(tmp_path):
    cfg = read_checkpoint_config(trainer_config(tmp_path, save_freq=3))
    assert [s for s in range(1, 11) if cfg.due(s, total_steps=10)] == [3, 6, 9, 10]  # and always the last step
    assert not any(read_checkpoint_config(trainer_config(tmp_path, save_freq=-1)).due(s, 10) for s in range(1, 11))
    assert cfg.root == os.path.abspath(tmp_path / "ckpt")


def test_commit_renames_then_writes_the_tracker(tmp_path):
    directory = CheckpointDir(str(tmp_path))
    partial = fake_checkpoint(tmp_path, 2, commit=False)
    assert partial.endswith("global_step_2.partial")
    assert directory.tracked_step() is None  # a partial checkpoint is never the tracked one
    fake_checkpoint(tmp_path, 2)
    assert directory.tracked_step() == 2 and directory.complete_steps() == [2]
    assert not os.path.exists(partial)
    assert open(tmp_path / TRACKER_FILE).read() == "2"


def test_a_crash_mid_write_leaves_the_previous_checkpoint_tracked(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, commit=False)  # the process died while writing step 4
    cfg = read_checkpoint_config(trainer_config(tmp_path, default_local_dir=str(tmp_path)))
    point = find_resume_point(cfg, train_world_size=1, dataloader_workers=0, dynamic_sampling=False)
    assert point.path.endswith("global_step_2") and point.state.global_step == 2
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", TRACKER_FILE]  # the resume removed the partial one


def test_a_save_interrupted_mid_swap_is_put_back(tmp_path):
    """A crash between moving an older global_step_4 aside and renaming its replacement in: the tracker
    names a directory that is not there. The resume puts the older one back and resumes it."""
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, dataloader_state={"_num_yielded": 444})
    os.rename(tmp_path / "global_step_4", tmp_path / "global_step_4.replaced")
    fake_checkpoint(tmp_path, 4, commit=False)
    cfg = read_checkpoint_config(trainer_config(tmp_path, default_local_dir=str(tmp_path)))
    point = find_resume_point(cfg, 1, 0, False)
    assert point.path == str(tmp_path / "global_step_4")
    assert torch.load(os.path.join(point.path, DATA_FILE)) == {"_num_yielded": 444}  # the older one, whole
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", "global_step_4", TRACKER_FILE]


def _auto(root):
    return read_checkpoint_config(trainer_config(root, default_local_dir=str(root)))


def test_auto_falls_back_to_the_newest_complete_checkpoint_below_a_broken_tracker(tmp_path, caplog):
    """A tracker naming a missing or incomplete directory, or no step: the newest complete checkpoint
    below it, with a warning naming both; never step 0 in silence."""
    for step in (2, 4):
        fake_checkpoint(tmp_path, step)
    fake_checkpoint(tmp_path, 8)  # an abandoned run's, above the tracker: not resumed
    CheckpointDir(str(tmp_path))._write_tracker(6)
    with caplog.at_level("WARNING", logger="async_rl.checkpoint_dir"):
        assert find_resume_point(_auto(tmp_path), 1, 0, False).path == str(tmp_path / "global_step_4")
    assert f"{tmp_path / TRACKER_FILE} names step 6, but {tmp_path / 'global_step_6'} is missing" in caplog.text
    assert f"resuming from the newest complete checkpoint, {tmp_path / 'global_step_4'}" in caplog.text
    os.remove(tmp_path / "global_step_4" / DATA_FILE)  # a copy cut short
    CheckpointDir(str(tmp_path))._write_tracker(4)
    caplog.clear()
    with caplog.at_level("WARNING", logger="async_rl.checkpoint_dir"):
        assert find_resume_point(_auto(tmp_path), 1, 0, False).path == str(tmp_path / "global_step_2")
    assert f"is incomplete (no {DATA_FILE})" in caplog.text
    (tmp_path / TRACKER_FILE).write_text("four")
    assert find_resume_point(_auto(tmp_path), 1, 0, False).path == str(tmp_path / "global_step_8")
    os.remove(tmp_path / TRACKER_FILE)  # no tracker: the newest complete one
    assert find_resume_point(_auto(tmp_path), 1, 0, False).path == str(tmp_path / "global_step_8")


def test_auto_stops_naming_a_tracker_with_nothing_complete_to_resume(tmp_path, caplog):
    fake_checkpoint(tmp_path, 4)
    os.remove(tmp_path / "global_step_4" / "actor" / "fsdp_config.json")
    with pytest.raises(AsyncConfigError, match=(f"trainer.default_local_dir='{tmp_path}'.*names step 4, but "
                                                f".*global_step_4 is incomplete.*trainer.resume_mode=disable")):
        find_resume_point(_auto(tmp_path), 1, 0, False)
    os.remove(tmp_path / TRACKER_FILE)  # no tracker, nothing complete: step 0, said so
    with caplog.at_level("WARNING", logger="async_rl.checkpoint_dir"):
        assert find_resume_point(_auto(tmp_path), 1, 0, False) is None
    assert f"no complete checkpoint in {tmp_path}" in caplog.text and "training from step 0" in caplog.text


class Unpickled:
    """Anything a pickle can build: loading it runs code of the file's choosing."""


def test_resume_loads_no_pickled_objects(tmp_path):
    """data.pt and async_rl_state.pt load with weights_only=True: a file holding a pickled object is
    refused, naming the file and the object's class; numpy values the pipeline saves come back as saved."""
    import numpy as np
    from PIL import Image

    from async_rl.core.plain_data import from_plain, to_plain

    path = fake_checkpoint(tmp_path, 2)
    torch.save({"_num_yielded": 2, "sampler": Unpickled()}, os.path.join(path, DATA_FILE))
    with pytest.raises(ValueError, match=f"{path}/{DATA_FILE} holds objects other than tensors and plain data "
                                         f"\\(.*Unpickled\\)"):
        find_resume_point(_auto(tmp_path), 1, 0, False)
    column = np.array([{"ground_truth": "12", "style": "rule"}, [np.int64(3), np.array([1.5, 2.5])]], dtype=object)
    saved = {"kl": np.float64(0.125), "ids": np.arange(6, dtype=np.int32).reshape(2, 3), "column": column,
             "names": np.array(["a", "bc"]), "image": Image.new("RGB", (3, 2), (10, 20, 30))}
    torch.save(to_plain(saved), os.path.join(path, DATA_FILE))
    loaded = from_plain(torch.load(os.path.join(path, DATA_FILE), weights_only=True))
    assert loaded["kl"] == 0.125 and loaded["ids"].dtype == np.int32 and loaded["ids"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert loaded["column"].dtype == object and loaded["column"][0] == column[0]
    assert loaded["column"][1][0] == 3 and loaded["column"][1][1].tolist() == [1.5, 2.5]
    assert loaded["names"].tolist() == ["a", "bc"] and loaded["names"].dtype == saved["names"].dtype
    assert loaded["image"].mode == "RGB" and loaded["image"].tobytes() == saved["image"].tobytes()
    with pytest.raises(TypeError, match="Unpickled is not plain data"):
        to_plain({"x": [Unpickled()]})


def test_commit_replaces_a_checkpoint_of_the_same_step(tmp_path):
    first = fake_checkpoint(tmp_path, 2, dataloader_state={"_num_yielded": 111})
    fake_checkpoint(tmp_path, 2, dataloader_state={"_num_yielded": 222})
    assert torch.load(os.path.join(first, DATA_FILE), weights_only=False) == {"_num_yielded": 222}
    assert sorted(os.listdir(tmp_path)) == ["global_step_2", TRACKER_FILE]


def test_rotation_keeps_the_newest_of_this_lineage(tmp_path):
    directory = CheckpointDir(str(tmp_path))
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    assert directory.rotate(keep=2, newest=8) == [2, 4] and directory.complete_steps() == [6, 8]
    assert directory.rotate(keep=None, newest=8) == []
    # resumed from 6 after a run that had reached 8: step 8 is another lineage's, left alone until overwritten
    fake_checkpoint(tmp_path, 7)
    assert directory.rotate(keep=1, newest=7) == [6] and directory.complete_steps() == [7, 8]


def test_auto_resumes_the_tracked_checkpoint_with_its_state(tmp_path):
    cfg = read_checkpoint_config(trainer_config(tmp_path))
    assert find_resume_point(cfg, 1, 0, False) is None  # nothing saved: from scratch
    fake_checkpoint(tmp_path / "ckpt", 2)
    fake_checkpoint(tmp_path / "ckpt", 4)
    point = find_resume_point(cfg, 1, 0, False)
    assert point.written_by == "async_rl" and point.path == str(tmp_path / "ckpt" / "global_step_4")
    assert (point.state.global_step, point.state.generated_batches, point.state.kl_coef) == (4, 5, 0.25)
    assert find_resume_point(read_checkpoint_config(trainer_config(tmp_path, resume_mode="disable")), 1, 0, False) is None


def test_a_checkpoint_from_verls_trainer_resumes_at_its_step(tmp_path):
    fake_checkpoint(tmp_path / "ckpt", 3, state=False, dataloader_state={"_num_yielded": 3})
    point = find_resume_point(read_checkpoint_config(trainer_config(tmp_path)), 1, 0, dynamic_sampling=False)
    assert point.written_by == "verl"
    assert (point.state.global_step, point.state.generated_batches) == (3, 3)
    assert point.state.dataloader_state == {"_num_yielded": 3}
    with pytest.raises(AsyncConfigError, match="algorithm.filter_groups.enable"):
        find_resume_point(read_checkpoint_config(trainer_config(tmp_path)), 1, 0, dynamic_sampling=True)


def test_a_checkpoint_that_does_not_fit_this_run_is_refused_at_start(tmp_path):
    fake_checkpoint(tmp_path / "ckpt", 2, world_size=2)
    cfg = read_checkpoint_config(trainer_config(tmp_path))
    with pytest.raises(AsyncConfigError, match="trainer.use_nodes_ratios=.*2 train ranks, as in the checkpoint"):
        find_resume_point(cfg, train_world_size=1, dataloader_workers=0, dynamic_sampling=False)
    with pytest.raises(AsyncConfigError, match="data.dataloader_num_workers=8"):
        find_resume_point(cfg, train_world_size=2, dataloader_workers=8, dynamic_sampling=False)
    # a run whose worker count the pipeline sized (the command did not name it) takes the checkpoint's
    point = find_resume_point(cfg, train_world_size=2, dataloader_workers=None, dynamic_sampling=False)
    assert dataloader_workers_in_state(point.state.dataloader_state) == 0 and dataloader_workers_in_state(None) is None


def test_a_ppo_run_needs_the_critic_part_of_its_checkpoint(tmp_path):
    """A run with a critic refuses a checkpoint without one (a GRPO run's) or with another critic rank count."""
    path = fake_checkpoint(tmp_path / "ckpt", 1)
    cfg = read_checkpoint_config(trainer_config(tmp_path))
    with pytest.raises(AsyncConfigError, match=f"trainer.default_local_dir=.*{path}/critic is missing \\(saved by a run without one\\)"):
        find_resume_point(cfg, 1, 0, False, critic_world_size=1)
    assert find_resume_point(cfg, 1, 0, False).path == path  # a run without a critic ignores it
    os.makedirs(os.path.join(path, "critic"))
    with open(os.path.join(path, "critic", "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": 2}, f)
    with pytest.raises(AsyncConfigError, match="trainer.use_nodes_ratios=.1 critic ranks.*2 critic ranks.*5th number"):
        find_resume_point(cfg, 1, 0, False, critic_world_size=1)
    assert find_resume_point(cfg, 1, 0, False, critic_world_size=2).path == path


def test_stage_checkpointer_commits_after_the_ranks_and_names_a_failed_write(tmp_path):
    """RunCheckpointer: training waits for the snapshot only; data.pt and the run state go in with the
    ranks' files; a write that fails surfaces at the next step."""
    from async_rl.checkpoints import RunCheckpointer

    class Remote:
        def __init__(self, fn):
            self.remote = fn

    class Dataloader:
        def __init__(self):
            self.state_before = Remote(self._state)

        async def _state(self, index):
            return {"_num_yielded": index}

    class Ranks:  # two train ranks whose background write finishes when told
        def __init__(self, fail=False):
            self.fail, self.paths = fail, []

        def snapshot_checkpoint(self, path, step):
            self.paths.append(path)
            return [{"snapshot_s": 0.01}, {"snapshot_s": 0.02}]

        def wait_checkpoint_written(self, timeout_s):
            if self.fail:
                raise OSError("disk full")
            os.makedirs(self.paths[-1], exist_ok=True)
            return [{"write_s": 1.0, "bytes": 10.0}, {"write_s": 1.0, "bytes": 12.0}]

    cfg = read_checkpoint_config(trainer_config(tmp_path, save_freq=1))

    async def main():
        saver = RunCheckpointer(cfg, total_steps=3, dataloader=Dataloader())
        ranks = Ranks()
        metrics = await saver.save(1, ranks, kl_coef=0.5)
        assert metrics["async/checkpoint/snapshot_s"] == 0.02 and metrics["timing_s/save_checkpoint"] > 0
        assert ranks.paths == [str(tmp_path / "ckpt" / "global_step_1.partial" / "actor")]
        assert await saver.wait() == 1
        assert saver.pop_written()["async/checkpoint/bytes"] == 22.0
        state = torch.load(tmp_path / "ckpt" / "global_step_1" / STATE_FILE, weights_only=False)
        assert state == vars(RunState(1, 1, {"_num_yielded": 1}, 0.5, None))
        assert CheckpointDir(cfg.root).tracked_step() == 1
        failing = Ranks(fail=True)
        await saver.save(2, failing)
        await asyncio.sleep(0.1)
        with pytest.raises(OSError, match="disk full"):
            saver.raise_if_failed()
        assert CheckpointDir(cfg.root).tracked_step() == 1  # the failed one is never tracked

    asyncio.run(main())


SNAPSHOT_SCRIPT = """
from async_rl.core.config import strip_async_keys
config = demo_config(**{"actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.actor.ppo_mini_batch_size": 16})
strip_async_keys(config)
ray.init(**ray_init_kwargs(config))
batch = demo_batch()
batch.batch["advantages"] = torch.randn(batch.batch["response_mask"].shape, generator=torch.Generator().manual_seed(1))
group = make_worker_group(config, "actor", 2, "snap")

def train_step():
    data = batch.select_idxs(np.arange(len(batch)))
    data.batch["old_log_probs"] = engine_calls.compute_log_prob(group, data, 1.0)
    data.batch["rollout_log_probs"] = data.batch["old_log_probs"]
    engine_calls.update_actor(group, data, config.actor_rollout_ref)

train_step()  # the optimizer has state to save
before = group.weight_digests()[0]
group.save_checkpoint(os.path.join(out_dir, "sync", "actor"), None, 1, None)   # verl's own, writes while training waits
snap = group.snapshot_checkpoint(os.path.join(out_dir, "deferred", "actor"), 1)
assert not [n for n in os.listdir(os.path.join(out_dir, "deferred", "actor")) if n.endswith(".pt")]
# the writer is held before its copy (ASYNC_RL_HOLD_AT): the next step must not change the weights yet
import threading, time
stepped = threading.Event()
threading.Thread(target=lambda: (train_step(), stepped.set()), daemon=True).start()
time.sleep(5)
held = not stepped.is_set()
open(os.path.join(out_dir, "checkpoint_copy@1.release"), "w").close()
assert stepped.wait(120)
after = group.weight_digests()[0]
written = group.wait_checkpoint_written(60.0)
fresh = make_worker_group(config, "actor", 2, "fresh")
fresh.load_checkpoint(os.path.join(out_dir, "deferred", "actor"), None, False)
done({"before": before, "after": after, "loaded": fresh.weight_digests()[0], "snapshot": snap, "written": written,
      "held": held})
"""


def _same(a, b) -> bool:
    """Equal nested state (tensors and DTensors compared by value)."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, torch.Tensor):
        a, b = (t.to_local() if isinstance(t, DTensor) else t for t in (a, b))
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):  # numpy RNG state
        return bool((a == b).all())
    return a == b


@pytest.mark.ray  # a Ray of its own
def test_deferred_write_holds_the_snapshot_and_verl_loads_it(demo_dir, tmp_path):
    """Two real FSDP2 ranks: the next training step's optimizer step waits for the snapshot's copy,
    the files written after it hold the state at the snapshot, equal to verl's own synchronous save,
    and verl's load_checkpoint restores it."""
    result = run_on_workers(SNAPSHOT_SCRIPT, demo_dir, tmp_path,
                            env={HOLD_AT_ENV: "checkpoint_copy@1", HOLD_DIR_ENV: str(tmp_path)})
    assert result["held"]  # the optimizer step waited for the copy
    assert result["before"] != result["after"]  # the step after the snapshot changed the weights
    assert result["loaded"] == result["before"]  # the deferred files hold the snapshot
    assert all(r["snapshot_s"] > 0 for r in result["snapshot"]) and all(r["bytes"] > 0 for r in result["written"])
    sync, deferred = tmp_path / "sync" / "actor", tmp_path / "deferred" / "actor"
    names = sorted(n for n in os.listdir(sync) if n.endswith(".pt"))
    assert names == sorted(n for n in os.listdir(deferred) if n.endswith(".pt")) and len(names) == 6  # 3 files x 2 ranks
    for name in names:
        a, b = (torch.load(d / name, weights_only=False) for d in (sync, deferred))
        if name.startswith("extra_state"):  # the RNG moved between the two saves only if something drew from it
            a, b = a["lr_scheduler"], b["lr_scheduler"]
        assert _same(a, b), name
    assert not [n for n in os.listdir(deferred) if n.endswith(".tmp")]
    assert json.loads((deferred / "fsdp_config.json").read_text()) == {"FSDP_version": 2, "world_size": 2}


def test_resume_path_picks_the_named_checkpoint_over_the_tracked_one(tmp_path):
    older = fake_checkpoint(tmp_path / "ckpt", 2)
    fake_checkpoint(tmp_path / "ckpt", 4)
    cfg = read_checkpoint_config(trainer_config(tmp_path, resume_mode="resume_path", resume_from_path=older))
    point = find_resume_point(cfg, 1, 0, False)
    assert point.path == older and point.state.global_step == 2


CRASH_SCRIPT = r"""
import asyncio, json, os, signal, sys, time, traceback
import numpy as np, torch
import torch.distributed.tensor  # what the writer thread imports, loaded once before the forks
import verl.utils.checkpoint.fsdp_checkpoint_manager as verl_manager
from omegaconf import OmegaConf
from async_rl.checkpoints import RunCheckpointer, read_checkpoint_config
from async_rl.core.fault_points import HOLD_AT_ENV, HOLD_DIR_ENV
from async_rl.training.checkpoint_writer import CheckpointWriter


class Ranks:
    # two train ranks, each with the CheckpointWriter a verl worker holds; `save` stands for verl's
    # save_checkpoint: verl's file names, written through the `torch` of verl's checkpoint manager module
    # (as verl's manager writes them: captured, then written by the writer thread), fsdp_config.json directly
    def __init__(self, tag):
        self.tag, self.writers = tag, [CheckpointWriter(), CheckpointWriter()]

    def snapshot_checkpoint(self, path, step):
        def save(rank):
            os.makedirs(path, exist_ok=True)
            for kind in ("model", "optim", "extra_state"):
                verl_manager.torch.save({"tag": self.tag, "step": step, "w": torch.full((256,), float(step))},
                                        os.path.join(path, f"{kind}_world_size_2_rank_{rank}.pt"))
            if rank == 0:
                with open(os.path.join(path, "fsdp_config.json"), "w") as f:
                    json.dump({"FSDP_version": 2, "world_size": 2}, f)
        return [w.snapshot(lambda r=r: save(r), step) for r, w in enumerate(self.writers)]

    def wait_checkpoint_written(self, timeout_s):
        return [w.wait(timeout_s) for w in self.writers]


class Remote:
    def __init__(self, fn):
        self.remote = fn


class Dataloader:
    def __init__(self, tag):
        async def state(index):
            return {"_num_yielded": index, "tag": tag}
        self.state_before = Remote(state)


def run_case(case):
    # each lineage: a RunCheckpointer saving its steps (the real writer); the last one's env holds a point
    cfg = read_checkpoint_config(OmegaConf.create({"trainer": {
        "save_freq": 2, "default_local_dir": case["root"], "max_actor_ckpt_to_keep": case.get("keep")}}))
    for tag, steps, hold in case["lineages"]:
        if hold:
            os.environ[HOLD_AT_ENV], os.environ[HOLD_DIR_ENV] = hold, case["holds"]
        saver, ranks = RunCheckpointer(cfg, total_steps=100, dataloader=Dataloader(tag)), Ranks(tag)

        async def save_all():
            for step in steps:
                await saver.save(step, ranks, kl_coef=np.float64(step) / 8)  # numpy, as verl's KL controller's
            await saver.wait()
        asyncio.run(save_all())


results = {}
for case in json.loads(sys.argv[1]):
    os.makedirs(case["holds"], exist_ok=True)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            run_case(case)
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    hold = [h for _, _, h in case["lineages"] if h]
    marker = os.path.join(case["holds"], hold[0]) if hold else None
    deadline, outcome = time.monotonic() + 120, None
    while outcome is None:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            outcome = f"exited {os.waitstatus_to_exitcode(status)}"
        elif marker and os.path.exists(marker):
            os.kill(pid, signal.SIGKILL)  # every thread of the writer, mid-save
            os.waitpid(pid, 0)
            outcome = "killed"
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            outcome = "timed out"
        else:
            time.sleep(0.01)
    results[case["name"]] = outcome
print(json.dumps(results))
"""

# (name, lineages as (tag, steps saved, fault point held in the last save), keep, the checkpoint a
# resume must find: (tag, step)). "next": a run that saved step 2 goes on to save 4; "again": a run resumed
# (resume_path) from step 2 of a run that had saved 4 saves 4 again; "rotate": max_actor_ckpt_to_keep=1
CRASHES = [
    ("next_copy", [("A", [2], None), ("B", [4], "checkpoint_copy@4")], None, ("A", 2)),
    ("next_write", [("A", [2], None), ("B", [4], "checkpoint_write@4")], None, ("A", 2)),
    ("next_commit", [("A", [2], None), ("B", [4], "checkpoint_commit@4")], None, ("A", 2)),
    ("next_tracker", [("A", [2], None), ("B", [4], "checkpoint_tracker@4")], None, ("A", 2)),
    ("next_done", [("A", [2], None), ("B", [4], None)], None, ("B", 4)),
    ("again_commit", [("A", [2, 4], None), ("B", [4], "checkpoint_commit@4")], None, ("A", 4)),
    ("again_swap", [("A", [2, 4], None), ("B", [4], "checkpoint_swap@4")], None, ("A", 2)),
    ("again_tracker", [("A", [2, 4], None), ("B", [4], "checkpoint_tracker@4")], None, ("A", 2)),
    ("again_done", [("A", [2, 4], None), ("B", [4], None)], None, ("B", 4)),
    ("rotate", [("A", [2], None), ("B", [4], "checkpoint_rotate@4")], 1, ("B", 4)),
]


def test_a_writer_killed_at_any_point_of_a_save_leaves_a_complete_checkpoint_to_resume(tmp_path):
    """The project's writer (RunCheckpointer, two ranks' CheckpointWriter threads, CheckpointDir) in a
    process SIGKILLed at each fault point of a save (async_rl/core/fault_points.py): verl's tracker then
    names a complete checkpoint, and `resume_mode=auto` resumes the newest one committed, every file of it
    from that one save, with nothing half written left behind."""
    import subprocess
    import sys

    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    from async_rl.checkpoint_dir import incomplete_reason
    from async_rl.checkpoints import load_plain

    cases = [{"name": name, "root": str(tmp_path / name / "ckpt"), "holds": str(tmp_path / name / "holds"),
              "lineages": lineages, "keep": keep} for name, lineages, keep, _ in CRASHES]
    proc = subprocess.run([sys.executable, "-c", CRASH_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    outcomes = json.loads(proc.stdout.strip().splitlines()[-1])
    for (name, lineages, keep, (tag, step)), case in zip(CRASHES, cases):
        held = lineages[-1][2]
        assert outcomes[name] == ("killed" if held else "exited 0"), (name, outcomes[name], proc.stderr[-3000:])
        root = case["root"]
        tracked_by_verl = find_latest_ckpt_path(root)  # verl's own rule, on the directory as the crash left it
        assert tracked_by_verl is not None and incomplete_reason(tracked_by_verl) is None, (name, os.listdir(root))
        point = find_resume_point(read_checkpoint_config(trainer_config(tmp_path, default_local_dir=root)),
                                  train_world_size=2, dataloader_workers=None, dynamic_sampling=False)
        assert point.path == os.path.join(root, f"global_step_{step}") and point.state.global_step == step, name
        actor = os.path.join(point.path, "actor")
        for file in sorted(os.listdir(actor)):
            if file.endswith(".pt"):
                saved = torch.load(os.path.join(actor, file), weights_only=True)
                assert (saved["tag"], saved["step"]) == (tag, step) and saved["w"].eq(step).all(), (name, file)
        assert len([f for f in os.listdir(actor) if f.endswith(".pt")]) == 6  # 3 files x 2 ranks
        assert load_plain(os.path.join(point.path, DATA_FILE)) == {"_num_yielded": step, "tag": tag}
        assert point.state.dataloader_state == {"_num_yielded": step, "tag": tag}
        assert point.state.kl_coef == step / 8 and type(point.state.kl_coef) is float
        assert not [n for n in os.listdir(root) if not (n.startswith("global_step_") and n[12:].isdigit())
                    and n != TRACKER_FILE], (name, os.listdir(root))  # nothing half written or moved aside left
        if keep == 1:  # the rotation the kill interrupted is finished: no half-removed checkpoint left
            assert sorted(os.listdir(root)) == sorted([TRACKER_FILE, f"global_step_{step}"]), (name, os.listdir(root))
