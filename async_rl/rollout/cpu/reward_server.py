"""CPU reward-model server: a discriminative reward model behind vLLM's `/classify` HTTP endpoint.

verl 0.9.1 scores with a reward model by posting each response, as text under the reward model's
chat template, to a router in front of the reward-model replicas (`RewardLoopWorker`,
`verl/experimental/reward_loop`); with vLLM the endpoint is `/classify` and the score is
`data[-1].probs[-1]`. This server answers the same request on CPU, so verl's reward loop (its
worker, router and reward managers, and a user's reward function posting to the router) runs
unchanged on the CPU backend. A *ForSequenceClassification model only: a generative reward model
(a user's function posting `/v1/chat/completions`) needs vLLM or SGLang.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Optional

import torch
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig

from async_rl.core.node_address import listen_socket, service_host

logger = logging.getLogger(__name__)

CLASSIFY_ENDPOINT = "/classify"
PORT_WAIT_S = 15.0


def scores_of(model, tokenizer, texts: list[str], max_length: int) -> list[list[float]]:
    """The model's logits (num_labels floats) for each text, tokenized as vLLM does (special tokens
    added), one sequence per forward (no padding can change a score). ValueError for a text over
    `max_length` tokens."""
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(ids) > max_length:
            raise ValueError(f"the reward model's input is {len(ids)} tokens, over its {max_length}")
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        out.append([float(x) for x in logits.float().tolist()])
    return out


def activated(logits: list[float]) -> list[float]:
    """vLLM's classify activation: sigmoid for one label, softmax for several."""
    t = torch.tensor(logits)
    return (t.sigmoid() if t.numel() == 1 else t.softmax(-1)).tolist()


class CPURewardModelServer:
    """Serve one reward-model replica on CPU: `classify` as a Ray method and as vLLM's HTTP `/classify`.

    Args:
        config: verl `RolloutConfig` of `reward.reward_model.rollout` (used: `max_model_len`).
        model_config: verl `HFModelConfig` of `reward.reward_model.model_path`.
        replica_rank: the replica's rank (names it in logs and errors).
        port: the HTTP port (a restarted server takes its predecessor's: verl's router keeps the address);
            None: one the kernel picks when the server binds. The server binds `service_host()`: loopback
            on a one-node Ray cluster, else its node's address; never every interface.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, replica_rank: int = 0,
                 port: Optional[int] = None, **kwargs: Any):
        self.config = omega_conf_to_dataclass(config, dataclass_type=RolloutConfig)
        self.model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        self.replica_rank = replica_rank
        self.model = None
        self.tokenizer = None
        self.max_length = 0
        self._lock = asyncio.Lock()  # one forward at a time: the model is the process's
        self._runner = None
        self._address = service_host()  # bound and advertised: loopback on one node, else the node's address
        self._port = port

    async def launch_server(self, *args: Any, **kwargs: Any) -> None:
        """Load the model (float32, eval) and start the HTTP endpoint. Idempotent."""
        if self.model is not None:
            return
        from aiohttp import web
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = self.model_config.local_path
        self.model = await asyncio.to_thread(
            lambda: AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval())
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        position_limit = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = int(self.config.max_model_len or position_limit or 2048)
        app = web.Application()
        app.router.add_post(CLASSIFY_ENDPOINT, self._http_classify)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # port 0: the kernel's pick, read back; a restarted server's port may still be held by the
        # process it replaces, a moment longer
        sock = await asyncio.to_thread(listen_socket, self._address, self._port or 0, PORT_WAIT_S)
        self._port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        logger.info("CPU reward model %d up: %s at %s:%d", self.replica_rank, path, self._address, self._port)

    def get_server_address(self) -> tuple[str, int]:
        """(node ip, port) of the HTTP endpoint."""
        return self._address, self._port

    async def classify(self, texts: list[str]) -> list[list[float]]:
        """Each text's logits (num_labels floats), in order."""
        async with self._lock:
            return await asyncio.to_thread(scores_of, self.model, self.tokenizer, texts, self.max_length)

    async def _http_classify(self, request):
        """vLLM's `/classify`: {"model", "input": str | [str], "use_activation": bool (default true)} ->
        {"data": [{"index", "label", "probs", "num_classes"}], ...}; a bad request answers 400 with the cause."""
        from aiohttp import web

        try:
            body = await request.json()
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
            logits = await self.classify([str(t) for t in texts])
        except (KeyError, TypeError, ValueError) as exc:
            return web.json_response({"error": f"reward model {self.replica_rank}: {type(exc).__name__}: {exc}"},
                                     status=400)
        use_activation = bool(body.get("use_activation", True))
        data = []
        for index, row in enumerate(logits):
            probs = activated(row) if use_activation else row
            data.append({"index": index, "label": f"LABEL_{max(range(len(row)), key=row.__getitem__)}",
                         "probs": probs, "num_classes": len(row)})
        return web.json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                                  "created": int(time.time()), "model": body.get("model"), "data": data})

    # verl's replica and reward-model manager call these; a CPU server has nothing to free
    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""

    async def shutdown(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def check_reward_model(path: str, trust_remote_code: bool = False) -> Optional[str]:
    """Why the CPU backend cannot serve the model at `path` as a reward model, or None (it can)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        return f"its config does not load: {exc}"
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        return (f"its architectures are {architectures}: the cpu backend serves discriminative reward models "
                "(*ForSequenceClassification, vLLM's /classify); a generative one needs vLLM or SGLang")
    return None
