"""scripts/engine_lines.py: lines of code as cloc counts them (no blanks, comments or docstrings)."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("engine_lines", Path(__file__).parents[1] / "scripts" / "engine_lines.py")
engine_lines = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(engine_lines)

SOURCE = '''"""Module docstring,
two lines."""

import os  # a trailing comment keeps its line


# a comment line
def f(x):
    """Docstring."""
    text = """a string that is
    not a docstring"""
    return x + len(text)


class C:
    """Class docstring."""

    value = 1
'''


def test_code_lines_skip_blank_lines_comments_and_docstrings_only():
    # import, def, text = (2 lines), return, class, value
    assert engine_lines.code_lines(SOURCE) == 7


def test_the_script_counts_every_engine_package_and_not_the_demo(capsys):
    assert engine_lines.main() == 0
    out = capsys.readouterr().out
    assert all(f"\n{p} " in out for p in engine_lines.PACKAGES)
    rows = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.splitlines()[2:]}
    assert rows["engine"] == [sum(rows[p][i] for p in engine_lines.PACKAGES) for i in range(3)]
    demo_files = len(list((engine_lines.ROOT / "async_rl" / "demo").rglob("*.py")))
    assert demo_files > 0 and rows["async_rl"][0] == len(list((engine_lines.ROOT / "async_rl").rglob("*.py"))) - demo_files
