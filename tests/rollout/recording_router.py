"""A user's load balancer for `rollout.router_config_path` (and a teacher's `inference.router_config_path`), as
verl's router YAML names one: `router_class: recording_router.RecordingRouter`. The Ray worker that builds it
needs this folder on its path."""

from __future__ import annotations

import json
import time

from verl.workers.rollout.router import GlobalRequestLoadBalancer


class RecordingRouter(GlobalRequestLoadBalancer):
    """verl's default balancer, built as verl builds a YAML's class: `(servers, the YAML as a dict)`. YAML keys:
    `record` (a file: one JSON line per acquire, `{"server", "request", "prompt_tokens"}`, and per release
    `{"released", "request"}`); `pick` (an index into the sorted server ids: every request goes there);
    `misbehave`: `unknown_server` (answers an id outside its pool) or `hang` (never answers)."""

    def __init__(self, servers, config: dict):
        super().__init__(servers=servers)
        self.record, self.pick, self.misbehave = config.get("record"), config.get("pick"), config.get("misbehave")

    def _write(self, line: dict) -> None:
        if self.record:
            with open(self.record, "a") as out:
                out.write(json.dumps(line) + "\n")

    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    def acquire_server(self, request_id: str, prompt_ids=None):
        if self.misbehave == "hang":
            time.sleep(3600)
        if self.misbehave == "unknown_server":
            return "10.0.0.1:1", None
        if self.pick is not None:
            server_id = sorted(self._servers)[int(self.pick)]
            handle = self._servers[server_id]
        else:
            server_id, handle = super().acquire_server(request_id)
        self._write({"server": server_id, "request": request_id, "prompt_tokens": len(prompt_ids or [])})
        return server_id, handle

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        self._write({"released": server_id, "request": request_id})
        if self.pick is None:
            super().release_server(server_id, request_id)
