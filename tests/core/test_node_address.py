"""Where the pipeline's servers listen (async_rl/core/node_address.py): one address of the node, a port
the kernel picks by binding."""

from __future__ import annotations

import errno
import socket
import threading

import pytest

from async_rl.core.node_address import LOOPBACK, bind_socket, listen_socket, service_host
from helpers.sockets import time_wait_ports


def test_port_zero_is_picked_by_binding_and_held_from_then_on():
    sock = bind_socket(LOOPBACK)
    try:
        host, port = sock.getsockname()
        assert host == LOOPBACK and port > 0
        with pytest.raises(OSError) as taken:  # no window between choosing and binding: it is ours
            bind_socket(LOOPBACK, port)
        assert taken.value.errno == errno.EADDRINUSE
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("", port))  # nor on every interface
    finally:
        sock.close()


def test_a_fixed_port_is_retried_while_its_predecessor_holds_it():
    held = bind_socket(LOOPBACK)
    port = held.getsockname()[1]
    threading.Timer(0.3, held.close).start()  # the predecessor's process goes
    sock = bind_socket(LOOPBACK, port, wait_s=30)
    try:
        assert sock.getsockname() == (LOOPBACK, port)
    finally:
        sock.close()


def test_a_listening_sockets_successor_binds_its_port_while_its_connections_wait_in_time_wait():
    listener = listen_socket(LOOPBACK)
    port = listener.getsockname()[1]
    with pytest.raises(OSError) as taken:  # listening: nobody shares its port
        bind_socket(LOOPBACK, port)
    assert taken.value.errno == errno.EADDRINUSE
    client = socket.create_connection((LOOPBACK, port))
    accepted, _ = listener.accept()
    accepted.close()  # the server closes first: its side of the connection waits out TIME_WAIT (60 s)
    client.recv(1)  # the server's FIN
    client.close()
    listener.close()  # the server's process is gone
    assert port in time_wait_ports()
    successor = listen_socket(LOOPBACK, port)  # at once, no wait
    try:
        assert successor.getsockname() == (LOOPBACK, port)
        socket.create_connection((LOOPBACK, port)).close()  # and listening
    finally:
        successor.close()


def test_servers_bind_loopback_on_one_node_and_the_nodes_address_on_several(monkeypatch):
    import ray

    assert service_host() == LOOPBACK  # outside Ray: only this machine's processes are clients
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.7")
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert service_host() == LOOPBACK  # one node alive
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert service_host() == "192.0.2.7"
