"""Weight transports, one module each, registered by name on import (async_rl/api/weights.py)."""

from param_update.transports import collective, object_store, shared_memory  # noqa: F401 - registers "collective", "store", "shm"
