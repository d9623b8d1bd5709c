"""`trainer.default_local_dir` on disk: verl's layout (`global_step_<N>/`, the tracker file), a save
written beside it and committed by one rename, rotation, and the repair of what a crash left mid-save."""

from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Optional

from async_rl.core.errors import AsyncConfigError
from async_rl.core.fault_points import hold_at

logger = logging.getLogger(__name__)

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's name (checkpoint_manager.get_checkpoint_tracker_filename)
DATA_FILE = "data.pt"  # verl's name for the dataloader state
PARTIAL_SUFFIX = ".partial"  # being written
REPLACED_SUFFIX = ".replaced"  # moved aside while a save of the same step takes its name
REMOVING_SUFFIX = ".removing"  # moved aside by rotation, being deleted
STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _fsync_tree(root: str) -> None:
    """Flush every file and directory under `root` to disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(os.path.join(dirpath, name))
        _fsync(dirpath)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def incomplete_reason(path: str) -> Optional[str]:
    """Why `path` is not a complete checkpoint, or None. Complete: `actor/fsdp_config.json` (verl's
    checkpoint manager writes it once the ranks' files are written) and `data.pt` (written last by
    verl's trainer; by the pipeline before the one rename that makes the directory `global_step_N`)."""
    if not os.path.isdir(path):
        return "missing"
    for part in (os.path.join("actor", "fsdp_config.json"), DATA_FILE):
        if not os.path.exists(os.path.join(path, part)):
            return f"incomplete (no {part})"
    return None


class CheckpointDir:
    """`trainer.default_local_dir`: partial writes, atomic commits, the tracker, rotation, and the
    repair of what a crash left mid-save (`recover`)."""

    def __init__(self, root: str):
        self.root = root

    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def partial_dir(self, step: int) -> str:
        return self.step_dir(step) + PARTIAL_SUFFIX

    @property
    def tracker(self) -> str:
        return os.path.join(self.root, TRACKER_FILE)

    def tracked_step(self) -> Optional[int]:
        """The step the tracker names; None without a tracker. ValueError for one that names no step."""
        if not os.path.exists(self.tracker):
            return None
        with open(self.tracker) as f:
            text = f.read().strip()
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{self.tracker} holds {text[:40]!r}, not a step number") from None

    def begin(self, step: int) -> str:
        """An empty `global_step_<step>.partial` (a crashed write of it is dropped)."""
        partial = self.partial_dir(step)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        return partial

    def recover(self) -> list[str]:
        """Repair what a crash left mid-save; returns the paths put back or removed. A checkpoint moved
        aside for a save of the same step goes back when that save never took its name (else it is
        removed); half-written (`.partial`) and half-removed (`.removing`) directories are removed."""
        if not os.path.isdir(self.root):
            return []
        done = []
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.endswith(REPLACED_SUFFIX):
                final = path[: -len(REPLACED_SUFFIX)]
                if not os.path.exists(final):
                    os.rename(path, final)
                    _fsync(self.root)
                    logger.warning("checkpoints: %s put back (a crash interrupted the save that replaced it)", final)
                    done.append(final)
                    continue
            elif not name.endswith((PARTIAL_SUFFIX, REMOVING_SUFFIX)):
                continue
            shutil.rmtree(path, ignore_errors=True)
            done.append(path)
        return done

    def resume_dir(self) -> Optional[str]:
        """`trainer.resume_mode=auto`'s checkpoint: the tracker's when complete; else the newest complete
        one below it (a warning names both); None when there is neither a tracker nor a complete checkpoint.
        AsyncConfigError naming the tracker when it names no complete checkpoint and none below it is."""
        try:
            tracked, unreadable = self.tracked_step(), None
        except ValueError as exc:
            tracked, unreadable = None, str(exc)
        if tracked is not None:
            why = incomplete_reason(self.step_dir(tracked))
            if why is None:
                return self.step_dir(tracked)
            problem = f"{self.tracker} names step {tracked}, but {self.step_dir(tracked)} is {why}"
        else:
            problem = unreadable or f"{self.tracker} is missing"
        steps = self.complete_steps()
        below = [s for s in steps if incomplete_reason(self.step_dir(s)) is None and (tracked is None or s < tracked)]
        if below:
            logger.warning("checkpoints: %s; resuming from the newest complete checkpoint, %s", problem,
                           self.step_dir(below[-1]))
            return self.step_dir(below[-1])
        if tracked is None and unreadable is None:
            if steps:
                logger.warning("checkpoints: no complete checkpoint in %s (%s); training from step 0", self.root,
                               ", ".join(f"{self.step_dir(s)}: {incomplete_reason(self.step_dir(s))}" for s in steps))
            return None
        raise AsyncConfigError("trainer.default_local_dir", self.root,
                               f"a directory with a complete checkpoint to resume (trainer.resume_mode=auto): {problem}, "
                               "and no complete checkpoint is below it; trainer.resume_mode=disable trains from step 0")

    def commit(self, step: int) -> str:
        """Make the complete `global_step_<step>.partial` the checkpoint `global_step_<step>` the tracker
        names. The fault points between its moves (async_rl/core/fault_points.py) are where tests kill it."""
        partial, final = self.partial_dir(step), self.step_dir(step)
        _fsync_tree(partial)
        hold_at("checkpoint_commit", step)
        if os.path.exists(final):  # from an earlier run of this step (e.g. after resume_path to an older step)
            if self._tracked_or_none() == step:  # never let the tracker name a directory about to move
                below = [s for s in self.complete_steps() if s < step and incomplete_reason(self.step_dir(s)) is None]
                if below:
                    self._write_tracker(below[-1])
            replaced = final + REPLACED_SUFFIX
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
            _fsync(self.root)
            hold_at("checkpoint_swap", step)
            os.rename(partial, final)
            _fsync(self.root)
            hold_at("checkpoint_tracker", step)
            self._write_tracker(step)
            shutil.rmtree(replaced, ignore_errors=True)
        else:
            os.rename(partial, final)
            _fsync(self.root)
            hold_at("checkpoint_tracker", step)
            self._write_tracker(step)
        return final

    def _tracked_or_none(self) -> Optional[int]:
        try:
            return self.tracked_step()
        except ValueError:
            return None

    def _write_tracker(self, step: int) -> None:
        """The tracker names `step`, atomically (a temporary file flushed to disk, renamed)."""
        with open(self.tracker + ".tmp", "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.tracker + ".tmp", self.tracker)
        _fsync(self.root)

    def complete_steps(self) -> list[int]:
        """Steps with a `global_step_<N>` directory (the pipeline writes no other kind than complete)."""
        if not os.path.isdir(self.root):
            return []
        return sorted(int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(self.root)) if m)

    def rotate(self, keep: Optional[int], newest: int) -> list[int]:
        """Keep the `keep` newest checkpoints up to step `newest` (later ones belong to an abandoned
        run and are overwritten as this one reaches them); never the tracked one. Each removed one is
        first renamed aside (`.removing`), so no half-deleted `global_step_<N>` is ever left. Returns steps removed."""
        if keep is None:
            return []
        tracked = self._tracked_or_none()
        mine = [s for s in self.complete_steps() if s <= newest]
        removed = [s for s in mine[: max(len(mine) - keep, 0)] if s != tracked]
        for step in removed:
            aside = self.step_dir(step) + REMOVING_SUFFIX
            os.rename(self.step_dir(step), aside)
            hold_at("checkpoint_rotate", newest)
            shutil.rmtree(aside, ignore_errors=True)
        return removed
