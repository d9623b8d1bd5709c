"""Bad data named by file and row: checks of verl's RL parquet files before Ray starts, and the
row of a prompt that breaks `data.truncation=error` at its batch.

At start (`check_rl_files`, train and val files): the prompt column (`data.prompt_key`) and
`reward_model` exist, no prompt is empty, every row's `reward_model` has a `ground_truth`
(verl's reward managers and this pipeline's reward stage read it). At a batch
(`prompt_too_long_error`): verl 0.9.1 left-truncates a long prompt whatever `data.truncation`
says; with `truncation=error` the pipeline refuses it instead, naming the file and row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional


class BadDataError(ValueError):
    """A data file or row the run cannot use; the message names the file and the row."""


def _as_list(files) -> list[str]:
    if files is None:
        return []
    if isinstance(files, (str, bytes)):
        return [str(files)]
    return [str(f) for f in files]


def _first(mask) -> int | None:
    """Index of the first True in a boolean array, or None."""
    import numpy as np

    hits = np.flatnonzero(np.asarray(mask, dtype=bool))
    return int(hits[0]) if len(hits) else None


def _empty_prompt_rows(column):
    """Boolean per row: no message with non-blank content (chat prompts) or a blank string."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        text = pc.fill_null(column, "")
        return np.asarray(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(text)), 0))
    messages = pc.list_flatten(column)
    content = pc.fill_null(pc.struct_field(messages, "content"), "")
    filled = np.asarray(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(content)), 0))
    per_row = np.bincount(np.asarray(pc.list_parent_indices(column)), weights=filled, minlength=len(column))
    return (per_row == 0) | np.asarray(column.is_null())


def check_rl_files(files, prompt_key: str = "prompt", label: str = "data.train_files",
                   refused_media: Optional[dict] = None) -> set:
    """Raise BadDataError naming the file and row of the first unusable row, or a file with a column of
    `refused_media` (column -> why: verl's data.image_key / video_key / audio_key, multimodal rows the run
    cannot serve); remote paths are skipped. Returns the columns the files have. Vectorised over each
    file's two columns (about 0.1 s per 100k rows).
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    columns: set = set()
    for path in _as_list(files):
        if path.startswith(("hdfs://", "s3://")) or not path.endswith(".parquet"):
            continue
        names = pq.read_schema(path).names
        columns.update(names)
        for column in (prompt_key, "reward_model"):
            if column not in names:
                raise BadDataError(f"{label}: {path} has no {column!r} column (columns: {names})")
        media = [column for column in (refused_media or {}) if column in names]
        if media:
            raise BadDataError(f"{label}: {path} has the multimodal column {media[0]!r}: {refused_media[media[0]]}")
        table = pq.read_table(path, columns=[prompt_key, "reward_model"])
        row = _first(_empty_prompt_rows(table.column(prompt_key)))
        if row is not None:
            raise BadDataError(f"{label}: {path} row {row}: the prompt ({prompt_key!r}) is empty")
        reward_model = table.column("reward_model").combine_chunks()
        has_field = getattr(reward_model.type, "get_field_index", lambda _: -1)("ground_truth") >= 0
        missing = (pc.or_(reward_model.is_null(), pc.struct_field(reward_model, "ground_truth").is_null())
                   if has_field else [True] * len(reward_model))
        row = _first(missing)
        if row is not None:
            raise BadDataError(
                f"{label}: {path} row {row}: 'reward_model' is {reward_model[row].as_py()!r}; verl's reward "
                "managers read reward_model['ground_truth']"
            )
    return columns


def agent_names_in(files) -> frozenset:
    """The distinct values of the `agent_name` column (the agent loop verl runs for each row) of the
    local parquet files, or none."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    names = set()
    for path in _as_list(files):
        if path.startswith(("hdfs://", "s3://")) or not path.endswith(".parquet"):
            continue
        if "agent_name" in pq.read_schema(path).names:
            column = pq.read_table(path, columns=["agent_name"]).column("agent_name")
            names |= {str(v) for v in pc.unique(column).to_pylist() if v is not None}
    return frozenset(names)


def locate_prompt(files: Iterable[str], prompt_key: str, raw_prompt) -> tuple[str, int] | None:
    """(file, row) of the first row whose prompt equals ``raw_prompt`` (a list of chat messages), or None."""
    import pandas as pd

    wanted = [dict(m) for m in raw_prompt]
    for path in _as_list(files):
        if not path.endswith(".parquet"):
            continue
        for row, prompt in enumerate(pd.read_parquet(path, columns=[prompt_key])[prompt_key]):
            if prompt is not None and not isinstance(prompt, str) and [dict(m) for m in prompt] == wanted:
                return path, row
    return None


def prompt_too_long_error(files, prompt_key: str, raw_prompt, length: int, max_prompt_length: int) -> BadDataError:
    """The error for a prompt of ``length`` tokens over ``data.max_prompt_length`` with truncation=error."""
    where = locate_prompt(files, prompt_key, raw_prompt)
    place = f"{where[0]} row {where[1]}" if where else "a row of data.train_files"
    return BadDataError(
        f"{place}: the prompt is {length} tokens, over data.max_prompt_length={max_prompt_length}, and "
        "data.truncation=error (any other data.truncation left-truncates it, as verl 0.9.1's agent loop does; "
        "data.filter_overlong_prompts=True drops such rows at start)"
    )
