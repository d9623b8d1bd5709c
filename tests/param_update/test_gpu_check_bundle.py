"""The GPU check kit's carry (scripts/gpu_bundle.py: wheels cut into parts that each fit one device call, put
back together there) and its `run` (scripts/gpu_check.sh: join, install, the worker step, the sync check),
on the CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = [sys.executable, str(ROOT / "scripts" / "gpu_bundle.py")]


def bundle(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BUNDLE, *map(str, args)], capture_output=True, text=True, timeout=60)


def probe_wheel(folder: Path) -> Path:
    """A one-module pure-Python wheel, `kitprobe` 1.0."""
    path = folder / "kitprobe-1.0-py3-none-any.whl"
    info = "kitprobe-1.0.dist-info"
    files = {"kitprobe/__init__.py": "VALUE = 7\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: kitprobe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_parts_put_back_together_bit_for_bit_and_name_what_is_missing(tmp_path):
    wheels, parts, out = tmp_path / "wheels", tmp_path / "bundle", tmp_path / "out"
    wheels.mkdir()
    contents = {f"w{i}.whl": os.urandom(n) for i, n in enumerate((150_000, 5, 90_000))}
    for name, data in contents.items():
        (wheels / name).write_bytes(data)
    assert bundle("split", wheels, parts, "--part-mib", 0.1).returncode == 0  # 104,857-byte parts
    folders = sorted(p.name for p in parts.iterdir())
    assert folders == ["1", "2", "3"]
    assert all((parts / f / "part").stat().st_size <= 104_857 for f in folders)
    status = bundle("status", parts)
    assert (status.returncode, status.stdout.strip()) == (0, f"{parts}: parts here [1, 2, 3] of 3; complete")
    assert bundle("join", parts, out).returncode == 0
    assert {p.name: p.read_bytes() for p in out.iterdir()} == contents

    (parts / "2" / "part").unlink()  # a part that has not arrived, and one that arrived damaged
    damaged = bytearray((parts / "3" / "part").read_bytes())
    damaged[0] ^= 1
    (parts / "3" / "part").write_bytes(bytes(damaged))
    status = bundle("status", parts)
    assert status.returncode == 3
    assert ("parts here [1] of 3; missing or damaged [2, 3]: carry each in a call on this same warm machine"
            in status.stdout)
    joined = bundle("join", parts, tmp_path / "again")
    assert joined.returncode == 3 and "missing or damaged [2, 3]" in joined.stderr
    assert not (tmp_path / "again").exists()
    assert "no part of a bundle" in bundle("status", tmp_path / "empty").stdout


def test_run_installs_the_bundle_then_runs_the_worker_step_and_the_sync_check(tmp_path):
    wheels, parts = tmp_path / "wheels", tmp_path / "bundle"
    wheels.mkdir()
    probe_wheel(wheels)
    assert bundle("split", wheels, parts, "--part-mib", 0.001).returncode == 0  # 1,048-byte parts: several
    assert len(list(parts.iterdir())) > 1
    env = {**os.environ, "PYTHON": sys.executable, "KIT_DEVICE": "cpu", "WORKER_SIZES": "tiny"}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "run", str(parts), "--device", "cpu", "--sizes", "tiny",
                          "--versions", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (parts / "site" / "kitprobe" / "__init__.py").read_text() == "VALUE = 7\n"  # installed from the parts
    assert re.search(r"^\[tiny\] step 2: .* (\d+) of \1 tensors changed$", run.stdout, re.M)  # the worker step
    assert "[tiny] bitwise: 0 of 26 tensors differ in each of 1 versions" in run.stdout  # the sync check

    (parts / "1" / "part").unlink()
    missing = subprocess.run(["bash", "scripts/gpu_check.sh", "run", str(parts)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 3
    assert "missing or damaged [1]" in missing.stderr and "[tiny] step" not in missing.stdout


def test_a_part_and_the_checkout_fit_one_device_call():
    # a device call carries 64 MiB: the checkout's tracked files and one part of PART_MIB
    part_mib = float(re.search(r"^PART_MIB=(\d+)", (ROOT / "scripts" / "gpu_check.sh").read_text(), re.M).group(1))
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    checkout = sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())
    assert checkout > 2**20  # the checkout was read
    assert part_mib * 2**20 + checkout <= 64 * 2**20, f"checkout {checkout / 2**20:.1f} MiB + a part of {part_mib} MiB"
