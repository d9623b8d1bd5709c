"""The error every config check raises: one message naming the key, the value and what is allowed."""

from __future__ import annotations

from typing import Any


class AsyncConfigError(ValueError):
    """A pipeline config key has a value that cannot work."""

    def __init__(self, key: str, value: Any, allowed: str):
        self.key = key
        super().__init__(f"invalid config: {key}={value!r}; allowed: {allowed}")
