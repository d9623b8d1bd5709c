"""Weight transports, one module each, registered by name on import (async_rl/api/weights.py): every module
of this folder is imported here, so a new transport is its own file."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
