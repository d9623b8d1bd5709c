"""verl's `rollout.router_config_path`: a user's load balancer choosing the replica of each model request.

The file is verl's router YAML: `router_class` (a class's full name, verl's `RequestLoadBalancer`
protocol) and whatever else the class reads; verl's `get_router_handle` builds it as a Ray actor with
`(servers, the file's dict)`, `servers` being `{server id: server handle}`. Under the flag it routes the
generate stage's agent-loop turns (`PipelineLLMClient`) and a distillation teacher's requests, as it
routes them under verl's trainer. A server id is its replica's address (`RolloutReplica._server_address`);
a restarted replica is removed from the router and added back under its new address.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from verl.workers.rollout.router import _load_router_yaml, _resolve_router_class, get_router_handle

from async_rl.core.errors import AsyncConfigError
from async_rl.core.timeouts import SETUP_TIMEOUT_S

ROUTER_KEY = "actor_rollout_ref.rollout.router_config_path"


class RouterError(RuntimeError):
    """A user's load balancer answered with something verl's protocol does not allow."""


def check_router_file(key: str, path: str) -> None:
    """Before Ray starts: the router YAML at `path` loads as verl loads it, names a `router_class`, and the
    class imports and is callable (AsyncConfigError naming `key`, the file and the cause)."""
    try:
        router_class = _load_router_yaml(str(path)).get("router_class")
        if not router_class:
            raise ValueError("the file has no `router_class` (the load balancer's full class name)")
        _resolve_router_class(str(router_class))
    except Exception as exc:  # noqa: BLE001 - verl's loaders raise several kinds; each is the same user error
        raise AsyncConfigError(key, path, f"a router YAML whose router_class imports ({type(exc).__name__}: "
                               f"{exc})") from None


def server_ids(replicas: Optional[list], count: int) -> list[str]:
    """The id the router knows each of `count` replicas by: its address where every replica has a distinct one
    (as verl's trainer names them), else `replica-<index>`."""
    addresses = [getattr(replica, "_server_address", None) for replica in replicas or []]
    if len(addresses) == count and None not in addresses and len(set(addresses)) == count:
        return [str(address) for address in addresses]
    return [f"replica-{index}" for index in range(count)]


class UserRouter:
    """The run's router actor for the rollout replicas: `acquire(client, request_id, **fields)` -> (replica
    index, server id) and `replace(index, new_id, handle)` after a restart. The actor's start is bounded by
    `setup_timeout_s`, each call into it by `timeout_s` (s); a router that does not answer in time raises
    TimeoutError naming `ROUTER_KEY`, and one that names a server outside its pool raises RouterError."""

    def __init__(self, handle, ids: list[str], timeout_s: float, setup_timeout_s: float = SETUP_TIMEOUT_S):
        self.handle, self.ids, self.timeout_s = handle, list(ids), float(timeout_s)
        self.setup_timeout_s = float(setup_timeout_s)
        self._started = False

    @classmethod
    def start(cls, path: str, handles: list, replicas: Optional[list], timeout_s: float) -> "UserRouter":
        """verl's `get_router_handle` on the file at `path`, its pool the replicas' servers (`handles`)."""
        ids = server_ids(replicas, len(handles))
        return cls(get_router_handle(dict(zip(ids, handles)), router_config_path=str(path)), ids, timeout_s)

    async def _start(self) -> None:
        """Wait, once, for the actor's first answer (a Ray worker importing the class), within setup_timeout_s."""
        if self._started:
            return
        try:
            await asyncio.wait_for(self.handle.get_all_servers.remote(), timeout=self.setup_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the load balancer of {ROUTER_KEY} did not start within "
                               f"{self.setup_timeout_s:g} s") from None
        self._started = True

    async def _bounded(self, call, what: str) -> Any:
        try:
            return await asyncio.wait_for(call, timeout=self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the load balancer of {ROUTER_KEY} did not answer {what} within "
                               f"{self.timeout_s:g} s (actor_rollout_ref.rollout.request_timeout_s)") from None

    async def acquire(self, client, request_id: str, **fields) -> tuple[int, str]:
        """The replica `client` (verl's LLMServerClient on this router) sends `request_id` to, through verl's
        `_acquire_server` (which passes the router only the fields it asks for)."""
        await self._start()
        server_id, _ = await self._bounded(client._acquire_server(request_id, **fields), "acquire_server")
        if server_id not in self.ids:
            client._release_server(server_id, request_id=request_id)
            raise RouterError(f"the load balancer of {ROUTER_KEY} chose server {server_id!r}, which is not one of "
                              f"its pool: {', '.join(self.ids)}")
        return self.ids.index(server_id), server_id

    async def replace(self, index: int, new_id: str, handle) -> None:
        """Replica `index` restarted: its old server leaves the router's pool, the new one joins as `new_id`."""
        await self._start()
        await self._bounded(self.handle.remove_servers.remote([self.ids[index]]), "remove_servers")
        await self._bounded(self.handle.add_servers.remote({new_id: handle}), "add_servers")
        self.ids[index] = new_id
