"""Size and shape of the engine (async_rl without its demo, state_machines, param_update, verl_patches).

Counts, per package and in all: physical lines, and lines of code as cloc counts them by
default (no blank lines, no comments, docstrings counted as comments). Then the layers
(`LAYERS`, docs/architecture.md): each folder with the folders it imports, any import of a
folder above it, and the imports of the project's own modules made inside functions.

    python scripts/engine_lines.py
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("async_rl", "state_machines", "param_update", "verl_patches")
EXCLUDED = (ROOT / "async_rl" / "demo",)  # the demo task: data, model, reward, not the engine

# The engine's layers, lowest first: a folder imports only folders of lower layers.
LAYERS = (
    ("verl_patches",),  # named patches of verl 0.9.1
    ("async_rl/core",),  # the types and rules every stage shares: messages, staleness, config keys, ...
    ("async_rl/api",),  # contracts: WeightTransport, WeightReceiver, RolloutBackend, their registries
    ("param_update/transports",),  # one module per weight transport
    ("param_update",),  # the weight sync: sender, staging, the overlapped sync, receivers
    ("async_rl/training", "async_rl/rollout/cpu"),  # verl's training workers; the CPU rollout engine
    ("async_rl/rollout",),  # rollout backends (the table), replica supervision, requests
    ("state_machines",),  # the stages
    ("async_rl/plan",),  # the placement planner's model of a step, from a run's metrics
    ("async_rl/report",),  # a run's report page, from its timeline and metrics
    ("async_rl", "async_rl/demo"),  # the driver and the plugin; the demo task
)
# Imports of the project's own modules inside functions, each for a reason the top of the module cannot
# meet (a process boundary, an import order): at most this many.
MAX_FUNCTION_LEVEL_IMPORTS = 10


def code_lines(source: str) -> int:
    """Lines holding a token that is not a comment, outside docstrings."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages (the demo included)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def project_imports() -> list[tuple[str, int, str, bool]]:
    """(module, line, imported module, at module level) of every import of the project's own modules."""
    modules = _modules()

    def resolve(name: str):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text())
        top = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in {resolve(n) for n in names} - {None, module}:
                out.append((module, node.lineno, target, id(node) in top))
    return out


def folder_of(module: str) -> str:
    path = _modules()[module].relative_to(ROOT)
    return str(path.parent)


def layer_of(folder: str) -> int:
    for index, folders in enumerate(LAYERS):
        if folder in folders:
            return index
    raise KeyError(f"{folder} is in no layer of scripts/engine_lines.py LAYERS")


def folder_imports() -> dict[str, set[str]]:
    """Folder -> the other folders its modules import."""
    edges: dict[str, set[str]] = {}
    for module, _, target, _ in project_imports():
        source, imported = folder_of(module), folder_of(target)
        if source != imported:
            edges.setdefault(source, set()).add(imported)
    return edges


def upward_imports() -> list[str]:
    """'module:line imports target' for each import of a folder of the same or a higher layer."""
    return [f"{module}:{line} imports {target}" for module, line, target, _ in project_imports()
            if folder_of(module) != folder_of(target) and layer_of(folder_of(target)) >= layer_of(folder_of(module))]


def function_level_imports() -> list[str]:
    return [f"{module}:{line} imports {target}" for module, line, target, top in project_imports() if not top]


def main() -> int:
    print(f"command: python {' '.join(sys.argv)}")
    print(f"{'package':<16} {'files':>5} {'physical':>9} {'code':>6}")
    totals = [0, 0, 0]
    for package in PACKAGES:
        files = [f for f in sorted((ROOT / package).rglob("*.py")) if not any(d in f.parents for d in EXCLUDED)]
        texts = [f.read_text() for f in files]
        row = [len(files), sum(t.count("\n") for t in texts), sum(code_lines(t) for t in texts)]
        totals = [a + b for a, b in zip(totals, row)]
        print(f"{package:<16} {row[0]:>5} {row[1]:>9} {row[2]:>6}")
    print(f"{'engine':<16} {totals[0]:>5} {totals[1]:>9} {totals[2]:>6}")
    print("\nlayers, lowest first (a folder imports only folders below it):")
    edges = folder_imports()
    for index, folders in enumerate(LAYERS):
        for folder in folders:
            print(f"  {index} {folder:<26} imports {', '.join(sorted(edges.get(folder, ()))) or '-'}")
    upward = upward_imports()
    print(f"imports of a folder not below: {len(upward)}" + "".join(f"\n  {line}" for line in upward))
    inside = function_level_imports()
    print(f"imports of the project's modules inside functions: {len(inside)} (at most "
          f"{MAX_FUNCTION_LEVEL_IMPORTS})" + "".join(f"\n  {line}" for line in inside))
    return 0


if __name__ == "__main__":
    sys.exit(main())
