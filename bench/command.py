"""The command that made a bench's numbers, as a newcomer types it from the repository root."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _relative(word: str) -> str:
    """A path inside the repository, relative to it (others as given)."""
    path = Path(word)
    if not path.is_absolute():
        return word
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return word


def command_line(argv: list[str] | None = None) -> str:
    """`python bench/<script> <args>` for `argv` (default: this process's), led by GLIBC_TUNABLES when
    set (it changes how memcpy stores: bench/store_floor.py)."""
    argv = list(sys.argv if argv is None else argv)
    words = ["python", *(_relative(word) for word in argv)]
    tunables = os.environ.get("GLIBC_TUNABLES")
    return (f"GLIBC_TUNABLES={tunables} " if tunables else "") + " ".join(shlex.quote(w) for w in words)


def git_commit() -> str:
    """The repository's commit (`git rev-parse HEAD`), with "+uncommitted changes" when tracked files differ
    from it; "unknown" outside a git checkout."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, timeout=30).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" +uncommitted changes" if dirty else "")
