"""Delta sync: a version sent as the values that changed since the one before, as receivers hold them.

The trainer holds float32; a receiver may hold another dtype (a bf16 rollout). What a receiver
serves is the trainer's weights cast to its dtype, so "changed" is decided there: the new version
cast to the held dtype against the previous one as it was sent (bit for bit, so -0.0 against 0.0
and NaN payloads count as changes). At bf16 and small learning rates most steps move a weight by
less than half a bf16 step, and its held value stays the same.

`DeltaEncoder` (the sender) keeps the previous version as sent and turns each tensor into what
goes on the wire, ordinary named tensors packed into buckets like a full version:

- `<name>` itself (in the held dtype) when it is new or when sending it whole is no larger;
- else `<name>` + `INDEX` (where the changed values are: the gaps between their flat positions,
  ascending from 0, as uint16 in int16 bits) and `<name>` + `VALUE` (the values there, held dtype),
  empty when nothing changed. Where two changes lie more than `GAP_LIMIT` apart, unchanged positions
  in between go too (with their values, which the receiver already holds), so every gap fits 16 bits;
- and first `BASE`, an int64 tensor holding the version the delta applies to.

`DeltaVersion` (the receiver) puts a staged version together from its base, the version it
serves: the base's tensor with the changed values written in (on the base's device), or the tensor sent
whole. Applying a delta gives exactly the bytes a full sync of the same version gives.

Both loops run in C where the machine builds param_update/delta_kernel.c (delta_kernel.py), else in
numpy; the encoder diffs tensors on `ENCODE_THREADS` threads while the next ones are cast. It keeps
the version before `previous` too (`spare`): once the caller says every transport has copied it out,
the next version is cast into its memory, already mapped, instead of new memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from param_update import delta_kernel

INDEX = "\x00delta_index"
VALUE = "\x00delta_value"
BASE = "\x00delta_base"  # the wire name of the base version's tensor
GAP_LIMIT = delta_kernel.GAP_LIMIT  # the largest gap between two sent positions: uint16
ENCODE_THREADS = 2  # tensors diffed at once, beside the cast of the next ones
ENCODE_AHEAD = 16  # tensors cast ahead of the oldest one still being diffed
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_held(tensor: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """`tensor` as a receiver holding `dtype` holds it (None: as it is), contiguous, on the CPU."""
    out = tensor.detach().to("cpu")
    if dtype is not None and out.dtype != dtype:
        out = out.to(dtype)
    return out.contiguous()


def fits(into: Optional[torch.Tensor], dtype: torch.dtype, shape: torch.Size) -> bool:
    """`into` can take a tensor of `dtype` and `shape` whole: of that dtype and shape, contiguous."""
    return into is not None and into.dtype == dtype and into.shape == shape and into.is_contiguous()


def cast_into(tensor: torch.Tensor, dtype: Optional[torch.dtype], into: Optional[torch.Tensor]) -> torch.Tensor:
    """`as_held(tensor, dtype)` of a CPU `tensor`, written into `into` when it `fits` and is on the CPU: the same
    bytes (torch's one CPU cast either way), in memory already mapped."""
    if (tensor.device.type != "cpu" or not fits(into, dtype or tensor.dtype, tensor.shape)
            or into.device.type != "cpu"):
        return as_held(tensor, dtype)
    return into.copy_(tensor.detach())


def changed_positions(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions where `new` and `old` (same dtype and shape, on the CPU) differ bit for bit, ascending.

    numpy's compare and `flatnonzero`: a third of the time of torch's `nonzero` on one core here."""
    bits = _BITS[new.element_size()]
    differ = new.reshape(-1).view(bits).numpy() != old.reshape(-1).view(bits).numpy()
    return torch.from_numpy(np.flatnonzero(differ).astype(np.int64, copy=False))


def wire_positions(changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a delta sends for `changed` (int64, ascending, >= 0) and INDEX on the wire, their gaps (from 0
    to the first, then between neighbours) as uint16 in int16 bits. Where a gap exceeds GAP_LIMIT, positions are
    added inside it (`with_bridges`); the gaps are computed once, and again only then."""
    gaps = np.diff(changed.numpy(), prepend=0)
    if gaps.size and int(gaps.max()) > GAP_LIMIT:
        changed = with_bridges(changed, torch.from_numpy(gaps))
        gaps = np.diff(changed.numpy(), prepend=0)
    if not gaps.size:
        return changed, torch.empty(0, dtype=torch.int16)  # (torch reads an empty numpy array with stride 0)
    return changed, torch.from_numpy(gaps.astype(np.uint16)).view(torch.int16)


def with_bridges(positions: torch.Tensor, gaps: torch.Tensor) -> torch.Tensor:
    """`positions` (int64, ascending, >= 0; `gaps` their int64 gaps from 0) with positions added wherever a gap
    exceeds GAP_LIMIT: every GAP_LIMIT-th position after the gap's start."""
    bridges = (gaps - 1).clamp_min(0) // GAP_LIMIT  # positions to add inside each gap
    starts = positions - gaps  # the position each gap starts from
    wide = bridges > 0
    count = bridges[wide]
    first = torch.repeat_interleave(starts[wide], count)
    step = torch.arange(int(count.sum())) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count) + 1
    added = first + step * GAP_LIMIT
    out = torch.empty(positions.numel() + added.numel(), dtype=torch.int64)
    out[torch.arange(positions.numel()) + torch.searchsorted(added, positions)] = positions
    out[torch.arange(added.numel()) + torch.searchsorted(positions, added)] = added
    return out


def positions_of(gaps: torch.Tensor) -> torch.Tensor:
    """The int64 flat positions INDEX's gaps (uint16 in int16 bits) stand for: their running sum, in one
    pass (numpy's cumsum into int64 from the uint16 view)."""
    return torch.from_numpy(np.cumsum(gaps.contiguous().numpy().view(np.uint16), dtype=np.int64))


def positions_on_device(gaps: torch.Tensor) -> torch.Tensor:
    """`positions_of` in torch on the gaps' own device (a GPU's staged delta), the same int64 positions."""
    return torch.cumsum(gaps.to(torch.int64) & 0xFFFF, 0)


def changes(new: torch.Tensor, old: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(INDEX, VALUE) of the delta from `old` to `new` (same dtype and shape, on the CPU), or None when sending
    `new` whole is no larger. delta_kernel.py's C loops where they take the tensor, else numpy's."""
    cap = (new.nbytes - 1) // (2 + new.element_size())  # the most positions a delta smaller than `new` has
    if cap < 0:
        return None
    native = delta_kernel.kernel()
    if native is not None and native.handles(new):
        return native.encode(new, old, cap)
    positions, gaps = wire_positions(changed_positions(new, old))
    return None if positions.numel() > cap else (gaps, new.reshape(-1)[positions])


def wire_name(name: str) -> tuple[str, Optional[str]]:
    """(tensor name, INDEX / VALUE / None) of a name on the wire."""
    for part in (INDEX, VALUE):
        if name.endswith(part):
            return name[: -len(part)], part
    return name, None


def _wire(name: str, held: torch.Tensor, delta: Optional[Future]) -> Iterator[tuple[str, torch.Tensor]]:
    sent = delta.result() if delta is not None else None
    if sent is None:
        yield name, held
    else:
        yield name + INDEX, sent[0]
        yield name + VALUE, sent[1]


class DeltaEncoder:
    """The sender's side: the previous version as sent, and the next one as a delta from it.

    Args:
        held_dtypes: tensor name -> the dtype receivers hold it in (a name not listed: as the trainer
            holds it).
    """

    def __init__(self, held_dtypes: Optional[dict[str, torch.dtype]] = None):
        self.held_dtypes = dict(held_dtypes or {})
        self.version: Optional[int] = None  # the version `previous` holds
        self.previous: dict[str, torch.Tensor] = {}
        self.spare_version: Optional[int] = None  # the version before `previous`, as sent ...
        self.spare: dict[str, torch.Tensor] = {}  # ... whose memory a later version may be cast into
        self._pool = ThreadPoolExecutor(ENCODE_THREADS, thread_name_prefix="delta-encode")

    def close(self) -> None:
        """Stop its diff threads (once idle)."""
        self._pool.shutdown(wait=False)

    def encode(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
               base: Optional[int], reuse_spare: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """`version` on the wire: a delta from `base` (which must be the version kept), or whole (`base`
        None); the version is kept as the next one's base as it goes. A tensor whose name repeats (tied
        weights) is sent once per name, as a full sync sends it. `reuse_spare`: the caller is done with
        `spare` (every transport has copied it out), so the version is cast into its memory."""
        if base is not None and base != self.version:
            raise ValueError(f"a delta from version {base} asked, the sender keeps version {self.version}")
        kept: dict[str, torch.Tensor] = {}
        if base is not None:
            yield BASE, torch.tensor([base], dtype=torch.int64)
        pending: deque = deque()  # (name, held, the delta's future or None: sent whole), in order
        spare = self.spare if reuse_spare else {}
        for name, tensor in named_tensors:
            held = cast_into(tensor, self.held_dtypes.get(name), spare.pop(name, None))
            if held.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                held = held.clone()  # the trainer's own memory, which training changes: keep a copy
            old = self.previous.get(name) if base is not None else None
            kept[name] = held
            whole = old is None or old.shape != held.shape or old.dtype != held.dtype
            pending.append((name, held, None if whole else self._pool.submit(changes, held, old)))
            while pending and (len(pending) > ENCODE_AHEAD or pending[0][2] is None or pending[0][2].done()):
                yield from _wire(*pending.popleft())
        while pending:
            yield from _wire(*pending.popleft())
        self.spare, self.spare_version = self.previous, self.version
        self.previous, self.version = kept, version


class DeltaVersion:
    """The receiver's side of one version: its wire tensors (name -> tensor) over `base` (canonical name
    -> the tensor it serves, of version `base_version`)."""

    def __init__(self, wire: dict[str, torch.Tensor], base: dict[str, torch.Tensor], base_version: Optional[int],
                 aliases: Optional[dict] = None):
        self.wire = wire
        self.base = base
        self.aliases = dict(aliases or {})
        sent_base = wire.get(BASE)
        self.delta_from = int(sent_base[0]) if sent_base is not None else None
        if self.delta_from is not None and self.delta_from != base_version:
            raise ValueError(f"a delta from version {self.delta_from} arrived, the receiver holds version {base_version}")

    def sent_whole(self, name: str) -> bool:
        """`name` (canonical) came whole: `tensor` returns what arrived, not a tensor put together."""
        return name in self.wire

    def tensor(self, name: str, into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The full tensor `name` (canonical) of the version: sent whole, or its base with the changes, put
        together in `into` (memory no longer served, of its dtype and shape) when given, else in a new tensor."""
        if name in self.wire:
            return self.wire[name]
        gaps, value = self.wire[name + INDEX], self.wire[name + VALUE]
        base = self.base[name].detach()
        reuse = fits(into, base.dtype, base.shape)
        out = into.copy_(base) if reuse else base.clone(memory_format=torch.contiguous_format)
        native = delta_kernel.kernel()
        if native is not None and native.handles(out):
            native.write(out, gaps, value)
            return out
        if out.device.type == "cpu":
            positions = positions_of(gaps)
        else:  # a register-buffer in device memory: put together there
            positions, value = positions_on_device(gaps.to(out.device)), value.to(out.device)
        if positions.numel() and int(positions[-1]) >= out.numel():
            raise ValueError(f"a changed position past the end of a tensor of {out.numel()} values")
        out.reshape(-1)[positions] = value
        return out
