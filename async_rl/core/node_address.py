"""Where the servers the pipeline starts listen: on one address of their node, on a port the kernel picks.

`service_host()` is the address a server binds and the one it advertises: loopback when the Ray
cluster is one node (every client of the server is a process of that node), else the node's
address as Ray advertises it (clients on other nodes reach it there, and only there: never every
interface). `bind_socket(host)` binds port 0, so the kernel picks a free port, read back from the
socket: nothing can take the port between choosing and binding it. A fixed port (a restarted
server keeps its predecessor's address) is retried while the old process still holds it.
`listen_socket` listens too, and lets a successor bind its port while the connections it accepted
wait out TIME_WAIT (60 s on Linux).
"""

from __future__ import annotations

import errno
import socket
import time

LOOPBACK = "127.0.0.1"


def service_host() -> str:
    """The address the calling process's servers bind and advertise: "127.0.0.1" on a one-node Ray
    cluster (or outside Ray), else this node's address as Ray advertises it."""
    import ray

    try:
        if not ray.is_initialized() or len([n for n in ray.nodes() if n.get("Alive")]) <= 1:
            return LOOPBACK
        return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - not in a Ray process after all: a local client only
        return LOOPBACK


def bind_socket(host: str, port: int = 0, wait_s: float = 0.0) -> socket.socket:
    """A TCP socket bound to (`host`, `port`), not yet listening; port 0: one the kernel picks
    (`sock.getsockname()[1]`). A port in use is retried for `wait_s` seconds, then OSError."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    deadline = time.monotonic() + wait_s
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        if port:  # a predecessor's port: its connections in TIME_WAIT do not hold it (port 0 stays exclusive:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # Linux lets reusers share unlistened ports)
        try:
            sock.bind((host, port))
            return sock
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def listen_socket(host: str, port: int = 0, wait_s: float = 0.0, backlog: int = 2048) -> socket.socket:
    """`bind_socket`, then listening (connections queue from here on, up to `backlog`). SO_REUSEADDR,
    set once bound (so port 0 stays the kernel's exclusive pick) and before listening, passes to every
    connection it accepts: a successor binding this port is not held off by them in TIME_WAIT."""
    sock = bind_socket(host, port, wait_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.listen(backlog)
    return sock
