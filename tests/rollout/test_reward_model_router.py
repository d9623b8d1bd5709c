"""verl's reward-model router as the pipeline runs it (async_rl/rollout/reward_router.py `launch_router`):
a process of its own in front of the reward model's servers, started again on its address when a server
comes back at a new one."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from async_rl.rollout.reward_router import launch_router
from helpers.sockets import time_wait_ports

START_GUARD_S = 30.0  # a router starts in about a second; TIME_WAIT holds a port for 60 s


def classify_server(score: float) -> tuple[ThreadingHTTPServer, str]:
    """A stand-in for a reward model's server: POST /classify answers `score` as vLLM's /classify does."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"data": [{"probs": [score]}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def classify(address: str) -> float:
    request = urllib.request.Request(f"http://{address}/classify", data=json.dumps({"input": "x"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        return json.load(answer)["data"][-1]["probs"][-1]


def test_a_router_started_again_on_its_address_serves_the_new_server_at_once():
    old, old_url = classify_server(0.25)
    new, new_url = classify_server(0.75)
    address, router = launch_router(None, [old_url], timeout_s=START_GUARD_S)
    try:
        assert [classify(address) for _ in range(3)] == [0.25] * 3  # answered as soon as launch_router returns
        router.kill()
        router.join(10)
        port = int(address.rsplit(":", 1)[1])
        assert port in time_wait_ports()  # the connections it served hold its port for 60 s
        again, router = launch_router(address, [new_url], timeout_s=START_GUARD_S)
        assert again == address
        assert classify(address) == 0.75
    finally:
        router.kill()
        old.shutdown()
        new.shutdown()


def test_a_router_whose_process_exits_before_it_starts_is_named():
    with pytest.raises(RuntimeError, match=r"router exited \(code 1\) before it started on 127\.0\.0\.1:\d+"):
        launch_router(None, None, timeout_s=START_GUARD_S)  # verl's router raises on no list at all
