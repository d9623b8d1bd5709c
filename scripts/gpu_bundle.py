"""A folder of wheels cut into numbered parts that each fit one device call, and put back together there
(scripts/gpu_check.sh; the standard library only: it runs before anything is installed).

    python3 scripts/gpu_bundle.py split WHEELS BUNDLE --part-mib 56   # BUNDLE/1/, BUNDLE/2/, ...
    python3 scripts/gpu_bundle.py status BUNDLE                       # which parts are here (exit 3: some missing)
    python3 scripts/gpu_bundle.py join BUNDLE DEST                    # the wheels into DEST (exit 3: some missing)

Part k is `BUNDLE/k/part` (bytes of one tar of WHEELS) with `BUNDLE/k/manifest.json` (the part count and every
part's sha256): whichever part is here names the ones that are not. A part is verified before it is used.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

MANIFEST = "manifest.json"
PART = "part"
MISSING = 3  # exit status: parts missing or damaged


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def split(wheels: Path, bundle: Path, part_bytes: int) -> list[Path]:
    """Tar `wheels`' files (sorted, no folders) and cut the tar into parts of at most `part_bytes`; returns the
    part folders."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(p for p in wheels.iterdir() if p.is_file()):
            tar.add(path, arcname=path.name)
    data = buffer.getvalue()
    chunks = [data[at:at + part_bytes] for at in range(0, len(data), part_bytes)]
    manifest = {"parts": len(chunks), "sha256": [sha256(c) for c in chunks], "bytes": len(data)}
    folders = []
    for number, chunk in enumerate(chunks, start=1):
        folder = bundle / str(number)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / PART).write_bytes(chunk)
        (folder / MANIFEST).write_text(json.dumps(manifest))
        folders.append(folder)
    return folders


def present(bundle: Path) -> tuple[int, list[int], list[int]]:
    """(part count, part numbers here and whole, part numbers missing or damaged), from any manifest found."""
    manifests = sorted(bundle.glob(f"*/{MANIFEST}"))
    if not manifests:
        return 0, [], []
    manifest = json.loads(manifests[0].read_text())
    here, missing = [], []
    for number, digest in enumerate(manifest["sha256"], start=1):
        part = bundle / str(number) / PART
        (here if part.is_file() and sha256(part.read_bytes()) == digest else missing).append(number)
    return manifest["parts"], here, missing


def join(bundle: Path, dest: Path) -> list[str]:
    """The parts put together and untarred into `dest`; returns the file names. Raises FileNotFoundError naming
    the parts missing."""
    count, here, missing = present(bundle)
    if not count or missing:
        raise FileNotFoundError(describe(bundle, count, here, missing))
    data = b"".join((bundle / str(number) / PART).read_bytes() for number in range(1, count + 1))
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        names = tar.getnames()
        tar.extractall(dest, filter="data")
    return names


def describe(bundle: Path, count: int, here: list[int], missing: list[int]) -> str:
    if not count:
        return f"no part of a bundle in {bundle}: carry its parts (bash scripts/gpu_check.sh bundle makes them)"
    return (f"{bundle}: parts here {here or 'none'} of {count}" + (
        f"; missing or damaged {missing}: carry each in a call on this same warm machine" if missing else "; complete"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("split")
    cut.add_argument("wheels", type=Path)
    cut.add_argument("bundle", type=Path)
    cut.add_argument("--part-mib", type=float, required=True)
    sub.add_parser("status").add_argument("bundle", type=Path)
    put = sub.add_parser("join")
    put.add_argument("bundle", type=Path)
    put.add_argument("dest", type=Path)
    args = parser.parse_args()
    if args.command == "split":
        for folder in split(args.wheels, args.bundle, int(args.part_mib * 2**20)):
            print(f"{(folder / PART).stat().st_size / 2**20:10.2f} MiB  {folder}")
        return 0
    if args.command == "status":
        count, here, missing = present(args.bundle)
        print(describe(args.bundle, count, here, missing))
        return 0 if count and not missing else MISSING
    try:
        names = join(args.bundle, args.dest)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return MISSING
    print(f"{len(names)} files from {args.bundle} into {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
