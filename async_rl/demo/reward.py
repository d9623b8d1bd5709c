"""Reward for the copy-digits demo task.

This file must stay standalone (standard library only): ``prepare`` copies it
verbatim to ``DIR/reward.py`` so verl can load it by file path
(``reward.custom_reward_function.path``) in Ray workers that may not have the
``async_rl`` package importable.
"""

NUM_DIGITS = 4


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Per-position partial credit in [0, 1].

    Compares the first ``len(ground_truth)`` characters of the decoded response
    with the target; anything after them (eos/pad text, extra digits) is
    ignored, and missing positions of a short response score 0.
    """
    target = str(ground_truth)
    if not target:
        return 0.0
    response = solution_str or ""
    hits = sum(1 for got, want in zip(response[: len(target)], target) if got == want)
    return hits / len(target)
