"""The JSONL rows a run logs (verl's file logger): by training step, and the validation rows."""

from __future__ import annotations


def step_rows(rows: list[dict]) -> dict[int, dict]:
    """Training-step metrics by step (rows carrying `training/global_step`)."""
    return {r["step"]: r["data"] for r in rows if "training/global_step" in r["data"]}


def every_step_with(rows: list[dict], steps: int, keys) -> dict[int, dict]:
    """Training-step metrics by step, asserting steps 1..`steps` were all logged, each with every one of `keys`."""
    by_step = step_rows(rows)
    assert sorted(by_step) == list(range(1, steps + 1))
    for step, metrics in by_step.items():
        missing = [key for key in keys if key not in metrics]
        assert not missing, f"step {step} lacks {missing}"
    return by_step


def val_rows(rows: list[dict]) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in rows if any(k.startswith("val-core/") for k in r["data"])}
