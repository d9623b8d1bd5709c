"""Which keys of verl's config a run reads, and who reads them: a recorder for tests, off unless
`ASYNC_RL_KEY_READS=<dir>` is in the environment (then the plugin installs it in every process that imports
verl: the driver and every Ray worker).

Each process appends one JSON line per new record to `<dir>/reads-<pid>.jsonl`:

- `key`: the dotted key read, its full path from the config's root;
- `how`: `read` (an attribute, an item, `get`, `in`, `OmegaConf.select`, a container made of its subtree),
  `write` (an assignment, an attribute or an item, by code outside OmegaConf: a merge's or `OmegaConf.update`'s
  inner writes are not recorded) or `class` (its subtree converted into a class by verl's
  `omega_conf_to_dataclass`: every leaf under it);
- `reader`: the module that read it (the first frame outside omegaconf, hydra and this module); for `class`,
  the class;
- `owner`: `verl`, `pipeline` (this project's packages) or `other`, the reader's;
- `via`: for a read by verl's code, the nearest pipeline module on the stack (the pipeline called verl), else null.

The recorder's own time in each process goes to `<dir>/cost-<pid>.json` ({"calls", "seconds"}).
A value that interpolates other keys (`${oc.select:data.max_prompt_length,512}`) reads them too. Not recorded:
Hydra composing the config, and the key checks marked `not_a_use` (they compare every key with verl's
default, which is not honouring it), verl's `validate_config` (checks too), and a container of the whole
config at once (a copy, or Tracking's log of it)."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import Any, Optional

ENV = "ASYNC_RL_KEY_READS"
PIPELINE_PACKAGES = ("async_rl", "state_machines", "param_update", "verl_patches")
# frames skipped when looking for the reader: OmegaConf's own and the standard library's machinery under it
_LIBRARY = ("omegaconf", "copy", "dataclasses", "functools", "typing", "contextlib", "collections", "_collections_abc",
            "abc", "enum", __name__)
_INTERPOLATED = re.compile(r"\$\{(?:oc\.select:)?([A-Za-z_][\w.]*)(?=[,}])")  # ${a.b}, ${oc.select:a.b,default}

_NOT_A_USE: set = set()  # code objects of the key checks
_state = threading.local()
_lock = threading.Lock()
_seen: set = set()
_out = None
_cost = {"calls": 0, "seconds": 0.0}  # the recorder's own time in this process, in `<dir>/cost-<pid>.json`


def not_a_use(fn):
    """Mark a function whose config reads are checks, not uses (they are not recorded)."""
    _NOT_A_USE.add(fn.__code__)
    return fn


def owner_of(module: str) -> str:
    top = module.split(".")[0]
    return "verl" if top == "verl" else "pipeline" if top in PIPELINE_PACKAGES else "other"


def _module_of(frame) -> str:
    name = frame.f_globals.get("__name__", "")
    if name == "__main__":  # `python -m verl.trainer.main_ppo`
        spec = frame.f_globals.get("__spec__")
        name = getattr(spec, "name", None) or name
    return name


def _reader(depth: int) -> Optional[tuple[str, Optional[str]]]:
    """(reader module, pipeline module that called verl or None), or None when the read is no use (inside a
    check, or Hydra composing the config)."""
    frame, reader, via = sys._getframe(depth), None, None
    while frame is not None:
        if frame.f_code in _NOT_A_USE:
            return None
        name = _module_of(frame)
        if reader is None:
            if name.split(".")[0] == "hydra":
                return None
            if not name.startswith(_LIBRARY):
                reader = name
        elif via is None and owner_of(name) == "pipeline":
            via = name
        frame = frame.f_back
    if reader is None:
        return None
    return reader, via if owner_of(reader) == "verl" else None


def _write(key: str, how: str, reader: str, via: Optional[str]) -> None:
    global _out
    record = (key, how, reader, via)
    if record in _seen:
        return
    with _lock:
        if record in _seen:
            return
        _seen.add(record)
        if _out is None:
            directory = os.environ[ENV]
            os.makedirs(directory, exist_ok=True)
            _out = open(os.path.join(directory, f"reads-{os.getpid()}.jsonl"), "a", buffering=1)
        _out.write(json.dumps({"key": key, "how": how, "reader": reader, "owner": owner_of(reader),
                               "via": via}) + "\n")
        _write_cost()


def _full_key(node, key) -> Optional[str]:
    try:
        full = node._get_full_key(key)
    except Exception:
        return None
    return full or None


def _prefix(node) -> str:
    try:
        return node._get_full_key(None) or ""
    except Exception:
        return ""


def _leaves(container, prefix: str):
    if isinstance(container, dict) and container:
        for name, child in container.items():
            yield from _leaves(child, f"{prefix}.{name}" if prefix else str(name))
    else:
        yield prefix, container


def _interpolated(value) -> list[str]:
    return _INTERPOLATED.findall(value) if isinstance(value, str) and "${" in value else []


def _count(start: float) -> None:
    _cost["calls"] += 1
    _cost["seconds"] += time.perf_counter() - start
    if _cost["calls"] % 2000 == 0:
        _write_cost()


def _write_cost() -> None:
    path = os.path.join(os.environ[ENV], f"cost-{os.getpid()}.json")
    tmp = f"{path}.{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(_cost, f)
    os.replace(tmp, path)


def _record_read(node, key, depth: int = 3, how: str = "read") -> None:
    if getattr(_state, "busy", False) or not isinstance(key, str) or key.startswith("__"):
        return
    _state.busy, start = True, time.perf_counter()
    try:
        who = _reader(depth)
        if who is None:
            return
        full = _full_key(node, key)
        if full is None:
            return
        _write(full, how, *who)
        if how == "write":
            return
        try:
            child = node._get_node(key)
            raw = child._value() if child is not None else None
        except Exception:
            raw = None
        for other in _interpolated(raw):
            _write(other, "read", *who)
    finally:
        _state.busy = False
        _count(start)


def _record_subtree(node, how: str, depth: int = 3, reader: Optional[str] = None) -> None:
    """Every leaf of `node` (a DictConfig) read at once: a container or a class made of it."""
    from omegaconf import DictConfig

    if getattr(_state, "busy", False) or not isinstance(node, DictConfig) or node._get_parent() is None:
        return  # the whole config at once: a copy or a log of it (Tracking's), no key's use
    _state.busy, start = True, time.perf_counter()
    try:
        who = _reader(depth)
        if who is None:
            return
        try:
            container = _ORIGINAL["to_container"](node, resolve=False)
        except Exception:
            return
        if reader is not None:  # a class: the reader is the class, the pipeline converting it the `via`
            who = (reader, who[0] if owner_of(who[0]) == "pipeline" else who[1])
        for key, value in _leaves(container, _prefix(node)):
            if key:
                _write(key, how, *who)
            for other in _interpolated(value):
                _write(other, how, *who)
    finally:
        _state.busy = False
        _count(start)


_ORIGINAL: dict[str, Any] = {}


def _class_name(config, dataclass_type) -> str:
    if dataclass_type is not None:
        return f"{dataclass_type.__module__}.{dataclass_type.__qualname__}"
    try:
        return str(_ORIGINAL["getitem"](config, "_target_"))  # not recorded: the class's name, no setting
    except Exception:
        return "unknown"


def install() -> None:
    """Wrap OmegaConf's reads and verl's `omega_conf_to_dataclass` in this process (idempotent)."""
    if _ORIGINAL:
        return
    from omegaconf import DictConfig, OmegaConf

    import verl.utils.config as verl_config

    _ORIGINAL.update(setattr=DictConfig.__setattr__, setitem=DictConfig.__setitem__,
                     getattr=DictConfig.__getattr__, getitem=DictConfig.__getitem__, get=DictConfig.get,
                     contains=DictConfig.__contains__, select=OmegaConf.select, to_container=OmegaConf.to_container,
                     to_object=OmegaConf.to_object, to_dataclass=verl_config.omega_conf_to_dataclass)

    def __getattr__(self, key):
        _record_read(self, key)
        return _ORIGINAL["getattr"](self, key)

    def __setattr__(self, key, value):
        if not _module_of(sys._getframe(1)).startswith("omegaconf"):  # a write of the caller's, not a merge's
            _record_read(self, key, how="write")
        return _ORIGINAL["setattr"](self, key, value)

    def __setitem__(self, key, value):
        if not _module_of(sys._getframe(1)).startswith("omegaconf"):
            _record_read(self, key, how="write")
        return _ORIGINAL["setitem"](self, key, value)

    def __getitem__(self, key):
        _record_read(self, key)
        return _ORIGINAL["getitem"](self, key)

    def get(self, key, default_value=None):
        _record_read(self, key)
        return _ORIGINAL["get"](self, key, default_value)

    def __contains__(self, key):
        _record_read(self, key)
        return _ORIGINAL["contains"](self, key)

    def select(cfg, key, *args, **kwargs):
        if isinstance(cfg, DictConfig) and isinstance(key, str) and not key.startswith("."):
            prefix = _prefix(cfg)
            parent, _, leaf = key.rpartition(".")
            node = _ORIGINAL["select"](cfg, parent) if parent else cfg
            if isinstance(node, DictConfig):
                _record_read(node, leaf)
            elif not getattr(_state, "busy", False):  # a parent absent: the key is still asked for
                _state.busy = True
                try:
                    who = _reader(2)
                    if who is not None:
                        _write(f"{prefix}.{key}" if prefix else key, "read", *who)
                finally:
                    _state.busy = False
        return _ORIGINAL["select"](cfg, key, *args, **kwargs)

    def to_container(cfg, *args, **kwargs):
        _record_subtree(cfg, "read")
        return _ORIGINAL["to_container"](cfg, *args, **kwargs)

    def to_object(cfg, *args, **kwargs):
        _record_subtree(cfg, "read")
        return _ORIGINAL["to_object"](cfg, *args, **kwargs)

    def omega_conf_to_dataclass(config, dataclass_type=None):
        _record_subtree(config, "class", reader=_class_name(config, dataclass_type))
        previous, _state.busy = getattr(_state, "busy", False), True  # its merge and copies are the class's
        try:
            return _ORIGINAL["to_dataclass"](config, dataclass_type)
        finally:
            _state.busy = previous

    DictConfig.__getattr__, DictConfig.__getitem__, DictConfig.get = __getattr__, __getitem__, get
    DictConfig.__setattr__, DictConfig.__setitem__ = __setattr__, __setitem__
    DictConfig.__contains__ = __contains__
    OmegaConf.select, OmegaConf.to_container, OmegaConf.to_object = (
        staticmethod(select), staticmethod(to_container), staticmethod(to_object))
    # verl's own checks of the config (the plugin calls them after the pipeline's) read it whole: no use
    not_a_use(getattr(verl_config.validate_config, "__wrapped__", verl_config.validate_config))
    for module in list(sys.modules.values()):  # those that imported verl's function before this ran
        names = getattr(module, "__dict__", None) or {}  # not getattr: lazy modules would import on it
        if names.get("omega_conf_to_dataclass") is _ORIGINAL["to_dataclass"]:
            module.omega_conf_to_dataclass = omega_conf_to_dataclass


def read_records(directory: str) -> list[dict]:
    """Every record the run's processes wrote under `directory`."""
    records = []
    for name in sorted(os.listdir(directory)):
        if name.startswith("reads-") and name.endswith(".jsonl"):
            with open(os.path.join(directory, name)) as f:
                records += [json.loads(line) for line in f if line.strip()]
    return records
