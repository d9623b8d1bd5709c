"""scripts/engine_lines.py: lines of code as cloc counts them (no blanks, comments or docstrings), and
the layers: no engine folder imports one of its own or a higher layer, and the project's own modules
are imported inside functions only where a process boundary or the import order requires it."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("engine_lines", Path(__file__).parents[2] / "scripts" / "engine_lines.py")
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
    table = out.split("\n\n")[0].splitlines()[2:]
    rows = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in table}
    assert rows["engine"] == [sum(rows[p][i] for p in engine_lines.PACKAGES) for i in range(3)]
    demo_files = len(list((engine_lines.ROOT / "async_rl" / "demo").rglob("*.py")))
    assert demo_files > 0 and rows["async_rl"][0] == len(list((engine_lines.ROOT / "async_rl").rglob("*.py"))) - demo_files
    assert "imports of a folder not below: 0" in out


def test_every_engine_folder_is_in_a_layer_and_imports_only_layers_below_it():
    folders = {engine_lines.folder_of(m) for m in engine_lines._modules()}
    assert folders == {f for layer in engine_lines.LAYERS for f in layer}
    assert engine_lines.upward_imports() == []


def test_an_import_of_a_higher_layer_is_found(tmp_path, monkeypatch):
    """The check itself: a core module importing a stage is reported, with its line."""
    fake = tmp_path / "async_rl" / "core"
    fake.mkdir(parents=True)
    for package in engine_lines.PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
    (tmp_path / "state_machines" / "stage.py").write_text("X = 1\n")
    (fake / "rule.py").write_text("import os\n\n\ndef f():\n    from state_machines.stage import X\n    return X\n")
    monkeypatch.setattr(engine_lines, "ROOT", tmp_path)
    assert engine_lines.upward_imports() == ["async_rl.core.rule:5 imports state_machines.stage"]
    assert engine_lines.function_level_imports() == ["async_rl.core.rule:5 imports state_machines.stage"]


def test_few_imports_inside_functions():
    inside = engine_lines.function_level_imports()
    assert len(inside) <= engine_lines.MAX_FUNCTION_LEVEL_IMPORTS, inside
