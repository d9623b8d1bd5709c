"""verl's reward-model router (`NaiveRouter`) in a process of its own, in front of the reward model's servers.

The process is spawned, not forked: the driver that starts it runs Ray's threads, and a fork copies the
locks they hold (a stream's, a module's) held forever in the child. Its socket listens before the process
starts, so a client that comes while a router starts again waits instead of being refused.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from typing import Optional

from async_rl.core.node_address import listen_socket, service_host


def serve_router(sock: socket.socket, worker_urls: list[str], ready) -> None:
    """verl's naive router (its FastAPI app) served by uvicorn on the listening socket `sock`; `ready`
    (an Event) is set once the app has started."""
    import uvicorn
    from verl.experimental.reward_loop.router.naive_router import NaiveRouter

    router = NaiveRouter(worker_urls=worker_urls, verbose=False)
    router.app.on_event("startup")(ready.set)  # after verl's own startup (its HTTP client)
    uvicorn.Server(uvicorn.Config(router.app, log_level="warning")).run(sockets=[sock])


def launch_router(address: Optional[str], worker_urls: list[str], timeout_s: float = 120.0):
    """verl's naive router in a process of its own, on `address` ("ip:port"; None: `service_host()` and a
    port the kernel picks), listening on that address only; returns (its address, the process) once its
    app has started. RuntimeError when its process exits first, TimeoutError when it has not started
    within `timeout_s` (s; connections queued meanwhile are then reset)."""
    if address is None:
        host, port = service_host(), 0
    else:
        host, port = address.rsplit(":", 1)
        host, port = host.strip("[]"), int(port)
    # a restarted router's port: its predecessor may hold it a moment (its connections in TIME_WAIT do not)
    sock = listen_socket(host, port, wait_s=timeout_s)
    port = sock.getsockname()[1]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    process = spawn.Process(target=serve_router, args=(sock, worker_urls, ready), daemon=True,
                            name="verl-reward-router")
    process.start()
    sock.close()  # the router's process holds its own copy
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.1):
        if not process.is_alive():
            raise RuntimeError(f"verl's reward-model router exited (code {process.exitcode}) before it started "
                               f"on {address}")
        if time.monotonic() > deadline:
            process.kill()
            raise TimeoutError(f"verl's reward-model router did not start on {address} within {timeout_s:g} s")
    return address, process
