"""bench/suite_cpu.py: a command's CPU by kind of process, from samples of every process."""

import json

from bench_script import run_bench

SPIN = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass\ntime.sleep(3)"


def test_a_childs_cpu_is_counted_under_its_label(tmp_path):
    # a script of its own name: the tool samples every process on the machine, and the suite's other lanes
    # run `python -c` processes of their own meanwhile (seen: three under that label)
    spin = tmp_path / "suite_cpu_spin.py"
    spin.write_text(SPIN)
    out = tmp_path / "cpu.json"
    proc = run_bench("suite_cpu.py", ["--every-s", "0.2", "--json", out, "--", "python3", "-u", str(spin)], tmp_path,
                     timeout_s=120)
    result = json.loads(out.read_text())
    rows = {r["label"]: r for r in result["labels"]}  # python3 -> "python", its options skipped, the script's name
    label = "python suite_cpu_spin.py"
    assert rows[label]["processes"] == 1, rows
    assert 1.3 <= rows[label]["cpu_s"] <= 2.5, rows  # its 1.5 s of spinning, seen by a sample in its 3 s after
    assert result["exit"] == 0 and result["busy_cpu_s"] >= 1.3
    assert label in proc.stdout and "command: python bench/suite_cpu.py" in proc.stdout
