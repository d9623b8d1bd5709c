"""Size of the engine (async_rl without its demo, state_machines, param_update, verl_patches).

Counts, per package and in all: physical lines, and lines of code as cloc counts them by
default (no blank lines, no comments, docstrings counted as comments).

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


def main() -> int:
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"{'package':<16} {'files':>5} {'physical':>9} {'code':>6}")
    totals = [0, 0, 0]
    for package in PACKAGES:
        files = [f for f in sorted((ROOT / package).rglob("*.py")) if not any(d in f.parents for d in EXCLUDED)]
        texts = [f.read_text() for f in files]
        row = [len(files), sum(t.count("\n") for t in texts), sum(code_lines(t) for t in texts)]
        totals = [a + b for a, b in zip(totals, row)]
        print(f"{package:<16} {row[0]:>5} {row[1]:>9} {row[2]:>6}")
    print(f"{'engine':<16} {totals[0]:>5} {totals[1]:>9} {totals[2]:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
