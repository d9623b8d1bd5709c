"""The command that made a bench's numbers, as a newcomer types it from the repository root, and the
commit it ran at."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = "/path/to"  # stands for the folders of a path outside the repository (no machine's paths in results)


def shown_path(word: str) -> str:
    """A path as results show it: inside the repository, relative to it; outside it, `/path/to/<name>`; `--opt=PATH` alike."""
    if word.startswith("-") and "=" in word:
        option, _, value = word.partition("=")
        return f"{option}={shown_path(value)}"
    path = Path(word)
    if not path.is_absolute():
        return word
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return f"{OUTSIDE}/{path.name}"


def commit(root: Path = ROOT) -> str:
    """HEAD's short hash of the checkout at `root`, with `+changes` when tracked files outside bench/results
    differ from it (the code that ran was not that commit's); `unknown` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def command_line(argv: list[str] | None = None) -> str:
    """`python bench/<script> <args>  # at commit <hash>` for `argv` (default: this process's), led by
    GLIBC_TUNABLES when set (it changes how memcpy stores: bench/store_floor.py)."""
    argv = list(sys.argv if argv is None else argv)
    words = ["python", *(shown_path(word) for word in argv)]
    tunables = os.environ.get("GLIBC_TUNABLES")
    return ((f"GLIBC_TUNABLES={tunables} " if tunables else "") + " ".join(shlex.quote(w) for w in words)
            + f"  # at commit {commit()}")
