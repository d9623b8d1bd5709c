"""What weights a verl vLLM replica serves, as per-tensor digests under the trainer's (HF) names.

The bit-identity check of the weight sync on verl's vLLM servers: equal digests mean the bytes
vLLM computes with are the trainer's. vLLM keeps some HF tensors fused (its model's
`packed_modules_mapping`: q/k/v in `qkv_proj`, gate/up in `gate_up_proj`) and pads the vocabulary
rows of its embedding; both are undone here before hashing.

The reading function runs inside vLLM's worker through `collective_rpc`, which sends a function
pickled only when `VLLM_ALLOW_INSECURE_SERIALIZATION=1` is set in the servers' environment (vLLM's
rule); without it the call fails naming the variable. Tensor parallel size 1 only (a shard's
digest is not the full tensor's).
"""

from __future__ import annotations

import asyncio
import os

import torch

ALLOW_PICKLE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
DIGEST_TIMEOUT_S = 120.0


def unfused_named_tensors(model: torch.nn.Module):
    """(HF name, tensor) pairs of a vLLM model: fused projections split along dim 0 by their output
    sizes, padded vocabulary rows dropped. Parameters shared by two modules appear once."""
    packed = getattr(model, "packed_modules_mapping", None) or {}
    for name, param in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = param.data
        vocab = getattr(module, "org_vocab_size", None)  # VocabParallelEmbedding / ParallelLMHead
        if vocab is not None:
            tensor = tensor[:vocab]
        parent, _, short = module_name.rpartition(".")
        if short in packed:
            sizes = list(module.output_partition_sizes)
            for part, piece in zip(packed[short], torch.split(tensor, sizes, dim=0), strict=True):
                yield f"{parent}.{part}.{leaf}", piece
        else:
            yield name, tensor


def worker_weight_digests(worker) -> dict[str, str]:
    """Inside a vLLM worker (`collective_rpc`): HF name -> digest of the weights it serves."""
    from param_update.buckets import tensor_digest

    return {name: tensor_digest(t) for name, t in unfused_named_tensors(worker.model_runner.model)}


def server_weight_digests(server, timeout_s: float = DIGEST_TIMEOUT_S):
    """Inside verl's `vLLMHttpServer` actor (Ray runs `__ray_call__` on a thread of its own): each
    vLLM worker's digests, read through `collective_rpc` on the actor's event loop; None on a server
    that does not own the engine (node rank > 0)."""
    engine = getattr(server, "engine", None)
    if engine is None:
        return None
    if os.environ.get(ALLOW_PICKLE_ENV) != "1":
        raise RuntimeError(f"reading vLLM's weights needs {ALLOW_PICKLE_ENV}=1 in the rollout servers' "
                           "environment (vLLM sends the reading function pickled only then)")
    loop = engine.output_handler.get_loop()  # AsyncLLM's output task runs on the actor's loop
    future = asyncio.run_coroutine_threadsafe(engine.collective_rpc(worker_weight_digests), loop)
    return future.result(timeout_s)


async def replica_weight_digests(server) -> dict[str, str]:
    """HF name -> digest of the weights a verl vLLM replica serves, read through its first server actor
    (node rank 0, the one that owns the engine); tensor parallel size 1."""
    per_worker = await server.__ray_call__.remote(server_weight_digests)
    if not per_worker or len(per_worker) != 1:
        raise RuntimeError(f"weight digests need one vLLM worker per replica (tensor_model_parallel_size=1); "
                           f"its first server reported {0 if not per_worker else len(per_worker)}")
    return per_worker[0]
