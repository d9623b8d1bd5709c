"""The recorder of config reads (async_rl/core/key_reads.py): off unless its environment variable is set; on,
it names each key by its full path and its reader, follows interpolations, and leaves out copies of the whole
config and verl's own checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from async_rl.core import key_reads

SCRIPT = """
import verl  # the plugin installs the recorder
from omegaconf import DictConfig, OmegaConf
from async_rl.core.config import select_value
from verl.utils.config import omega_conf_to_dataclass

config = OmegaConf.create({"trainer": {"project_name": "p", "default_local_dir": "ckpt/${trainer.project_name}"},
                           "algorithm": {"kl_ctrl": {"_target_": "verl.trainer.config.KLControlConfig",
                                                     "type": "fixed", "kl_coef": 0.1, "horizon": 5, "target_kl": 0.2}},
                           "data": {"unused": 1}})
select_value(config, "trainer.default_local_dir", None)  # the pipeline's read
OmegaConf.to_container(config)  # a copy of the whole config: no key's use
omega_conf_to_dataclass(config.algorithm.kl_ctrl)  # called from here (no pipeline frame): verl's class
config.trainer.written = 1
print(DictConfig.__getattr__.__module__)
"""


def test_off_unless_its_variable_is_set():
    """The plugin loaded in this process without the variable: OmegaConf's methods are OmegaConf's own."""
    from omegaconf import DictConfig, OmegaConf

    assert key_reads.ENV not in os.environ and not key_reads._ORIGINAL
    assert DictConfig.__getattr__.__module__ == "omegaconf.dictconfig"
    assert OmegaConf.select.__module__ == "omegaconf.omegaconf"


def test_it_records_each_key_by_its_full_path_and_reader(tmp_path):
    env = {**os.environ, key_reads.ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == key_reads.__name__  # installed
    records = {(r["key"], r["how"], r["reader"]) for r in key_reads.read_records(str(tmp_path))}
    assert ("trainer.default_local_dir", "read", "async_rl.core.config") in records
    assert ("trainer.project_name", "read", "async_rl.core.config") in records  # through the interpolation
    kl = "verl.trainer.config.KLControlConfig"  # its `_target_`
    assert {(f"algorithm.kl_ctrl.{k}", "class", kl) for k in ("type", "kl_coef", "horizon", "target_kl")} <= records
    assert ("trainer.written", "write", "__main__") in records
    assert ("algorithm.kl_ctrl._target_", "read", "__main__") not in records  # the class's name: no read
    assert not {r for r in records if r[0].startswith("data.")}  # the whole config's copy is no read of data.*
    json.loads((tmp_path / next(n for n in os.listdir(tmp_path) if n.startswith("cost-"))).read_text())
