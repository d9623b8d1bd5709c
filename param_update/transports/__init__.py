"""Weight transports, one module each, registered by name on import (async_rl/api/weights.py)."""

from param_update.transports import object_store, shared_memory  # noqa: F401 - registers "store" and "shm"
