"""A stand-in for a verl rollout server's actor handle (`handle.generate.remote(**kwargs)`): each
request is recorded and answered by a script."""

from __future__ import annotations

from collections.abc import Callable


class ScriptedServer:
    """`answer(kwargs, earlier_calls) -> (token_ids, version, stop_reason)` (version: None for none);
    every request's kwargs are kept in `calls`, in order."""

    def __init__(self, answer: Callable[[dict, list], tuple]):
        self.calls: list[dict] = []
        server = self

        class _Generate:
            @staticmethod
            async def remote(**kwargs):
                from verl.workers.rollout.replica import TokenOutput

                tokens, version, stop = answer(kwargs, list(server.calls))
                server.calls.append(kwargs)
                fields = {} if version is None else {"token_versions": [version] * len(tokens)}
                return TokenOutput(token_ids=list(tokens), log_probs=[-0.5] * len(tokens), stop_reason=stop,
                                   extra_fields=fields)

        self.generate = _Generate()

    def __reduce__(self):
        # sent to another process (a router actor's pool), it arrives as its name: unpickling its script there
        # would rebind this process's copy of the script to the unpickled one
        return str, (f"ScriptedServer@{id(self):x}",)
