"""Reward for the lookup demo task (an agent calls a lookup tool until it reaches a value).

This file must stay standalone (standard library only): ``prepare`` copies it verbatim to
``DIR/lookup_reward.py`` so verl can load it by file path (``reward.custom_reward_function.path``).

A trajectory's text (special tokens skipped) is the model's turns with the tool's replies between
them; every reply is ``"\\n" + ITEM_CHARS characters + "="`` (``REPLY``), a model turn is at most
``ITEM_CHARS`` characters (one character a token), so the replies split the text into the model's
turns. ``ground_truth`` is the turns a perfect agent writes, joined by ``"|"``: a call (``" "`` + a
4-digit key) for each lookup, then the value (5 digits).
"""

import re

ITEM_CHARS = 5  # a call (" " + a 4-digit key) or a value (5 digits)
REPLY = re.compile(r"\n[ 0-9]{%d}=" % ITEM_CHARS)
TURN_SEPARATOR = "|"


def model_turns(solution_str: str) -> list:
    """The model's turns of a trajectory's text, in order."""
    return REPLY.split(solution_str or "")


def is_call(turn: str) -> bool:
    """A turn that starts with a space calls the lookup tool; any other turn is the final answer."""
    return turn.startswith(" ")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Credit in [0, 1]: each turn's per-character match with the perfect agent's turn, summed over
    the perfect agent's turns and divided by their number (a missing turn scores 0). The value is
    only in the tool's replies: without calling the tool a model scores at most 0.8 / turns (the
    key's digits in its first turn), 0.4 at best."""
    expected = str(ground_truth).split(TURN_SEPARATOR)
    credit = sum(sum(1 for a, b in zip(got, want) if a == b) / len(want)
                 for want, got in zip(expected, model_turns(solution_str)))
    return credit / len(expected)
