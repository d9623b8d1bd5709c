"""Checkpoint payloads as plain data: what `torch.load(..., weights_only=True)` reads.

`weights_only=True` builds tensors, numbers, strings, bytes, None, and lists, tuples and dicts of
them, and runs no other code from the file. `to_plain` turns what the pipeline saves into that
form: numpy arrays and scalars (dataloader columns, a KL coefficient), PIL images (a vision task's
rows) and verl's `DataProto` rows (`rows_to_plain`); `from_plain` turns it back, arrays with their
dtype and shape, object arrays element by element.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

NDARRAY = "__async_rl_ndarray__"  # {NDARRAY: dtype str, "shape": [...], "items": flat list}
IMAGE = "__async_rl_image__"  # {IMAGE: PIL mode, "size": [w, h], "data": raw bytes}
PRIMITIVES = (type(None), bool, int, float, complex, str, bytes)


def to_plain(obj: Any) -> Any:
    """`obj` with every numpy array, numpy scalar and PIL image replaced by plain data; TypeError naming
    any other object (it would need unpickling to load)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, np.ndarray):
        items = obj.ravel().tolist()
        if obj.dtype == object:
            items = [to_plain(x) for x in items]
        return {NDARRAY: obj.dtype.str, "shape": list(obj.shape), "items": items}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, PRIMITIVES):
        return obj
    if isinstance(obj, dict):
        return {to_plain(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(to_plain(x) for x in obj)
    if _is_image(obj):
        return {IMAGE: obj.mode, "size": list(obj.size), "data": obj.tobytes()}
    raise TypeError(f"{type(obj).__module__}.{type(obj).__qualname__} is not plain data (tensors, numbers, "
                    "strings, numpy arrays, images, and lists, tuples and dicts of them)")


def from_plain(obj: Any) -> Any:
    """The inverse of `to_plain`."""
    if isinstance(obj, dict):
        if NDARRAY in obj:
            dtype = np.dtype(obj[NDARRAY])
            if dtype == object:
                out = np.empty(len(obj["items"]), dtype=object)
                for i, item in enumerate(obj["items"]):
                    out[i] = from_plain(item)
                return out.reshape(obj["shape"])
            return np.array(obj["items"], dtype=dtype).reshape(obj["shape"])
        if IMAGE in obj:
            from PIL import Image

            return Image.frombytes(obj[IMAGE], tuple(obj["size"]), obj["data"])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(x) for x in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(x) for x in obj)
    return obj


def rows_to_plain(rows) -> dict:
    """A verl `DataProto` as plain data: its tensors, its non-tensor columns and its meta_info."""
    tensors = {} if rows.batch is None else {k: v.detach() for k, v in rows.batch.items()}
    non_tensors = {}
    for key, column in rows.non_tensor_batch.items():
        try:
            non_tensors[key] = to_plain(column)
        except TypeError as exc:
            raise TypeError(f"non-tensor column {key!r}: {exc}") from exc
    return {"tensors": tensors, "non_tensors": non_tensors, "meta_info": to_plain(dict(rows.meta_info))}


def rows_from_plain(plain: dict):
    """The `DataProto` `rows_to_plain` was given."""
    from verl import DataProto

    return DataProto.from_dict(plain["tensors"], from_plain(plain["non_tensors"]), from_plain(plain["meta_info"]))


def _is_image(obj: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - Pillow comes with transformers
        return False
    return isinstance(obj, Image.Image)
