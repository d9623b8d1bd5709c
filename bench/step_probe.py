"""Spans at verl's and this package's boundaries, for bench/step_parts.py (nothing else loads it).

`bench/step_parts.py` starts a run with `STEP_PARTS_DIR` set and a `sitecustomize` that calls
:func:`install` in every Python process of the run (the driver, Ray's workers). Each wrapped
function, when it runs, appends one line `[name, start, end, cpu, extra]` to
`$STEP_PARTS_DIR/spans-<pid>.jsonl`: `start` / `end` on the machine's monotonic clock (s, the same
in every process), `cpu` the calling thread's CPU seconds over the call (sync functions only; an
async one's thread also runs other coroutines meanwhile), `extra` a dict (rows, tokens). The
functions are wrapped when their module is imported (`verl_patches.post_import.when_imported`), so a
process that never loads a module pays nothing for it; the code measured is unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import threading
import time

ENV = "STEP_PARTS_DIR"
_LOCK = threading.Lock()
_FILE = None


def record(name: str, start: float, end: float, cpu: float | None = None, **extra) -> None:
    """Append one span to this process's file."""
    global _FILE
    line = json.dumps([name, round(start, 6), round(end, 6), None if cpu is None else round(cpu, 6), extra])
    with _LOCK:
        if _FILE is None:
            _FILE = open(os.path.join(os.environ[ENV], f"spans-{os.getpid()}.jsonl"), "a", buffering=1)
        _FILE.write(line + "\n")


def timed(name: str, fn, extra=None):
    """`fn` (sync or async) recording a span `name` per call; `extra(args, kwargs)` -> dict, taken at entry."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            info = extra(args, kwargs) if extra else {}
            start = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                record(name, start, time.monotonic(), None, **info)
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            info = extra(args, kwargs) if extra else {}
            start, cpu = time.monotonic(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                record(name, start, time.monotonic(), time.thread_time() - cpu, **info)
    wrapper.__step_probe__ = True
    return wrapper


async def _awaited():
    """A coroutine function, to tell verl's `auto_await` wrapper by its code."""


def wrap(owner, attr: str, name: str, extra=None) -> None:
    """Replace `owner.attr` by its timed version (once; a missing attribute is left alone). For a class decorated
    `@ray.remote` at module level pass Ray's copy of it (`actor_class`), wrapped before Ray pickles it by value at
    the first `.remote()` of the process that creates the actor."""
    fn = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if fn is None or getattr(fn, "__step_probe__", False):
        return
    from verl.utils.ray_utils import auto_await

    if getattr(fn, "__code__", None) is auto_await(_awaited).__code__:
        # verl's `auto_await` looks at its caller's frame to hand an awaiting caller the coroutine: the timed
        # coroutine goes inside it, so that its caller stays the function's own
        wrapped = auto_await(timed(name, fn.__wrapped__, extra))
        wrapped.__step_probe__ = True
        setattr(owner, attr, wrapped)
        return
    setattr(owner, attr, timed(name, fn, extra))


def actor_class(remote):
    """The class Ray made of a `@ray.remote` class: it holds a copy of each method, and Ray pickles it (by value)
    for the actor's process."""
    return remote.__ray_metadata__.modified_class


def _marked_timer(debug) -> None:
    """verl's `marked_timer(name, timing_raw)` blocks (`timing_s/<name>`) as spans `timer/<name>`."""
    original = debug.marked_timer

    @contextlib.contextmanager
    def marked_timer(name, *args, **kwargs):
        start = time.monotonic()
        try:
            with original(name, *args, **kwargs) as value:
                yield value
        finally:
            record(f"timer/{name}", start, time.monotonic())

    debug.marked_timer = marked_timer


def _forward_rows(args, kwargs):
    batch, prefill = args[1], args[2]
    return {"decode_rows": sum(not s.done for s in batch.seqs), "prefill_rows": len(prefill),
            "prefill_tokens": sum(len(s.all_ids) for s in prefill)}


def _patches():
    def verl_trainer():
        from verl.trainer.ppo.v1 import trainer_base

        for attr in ("prepare_step", "_balance_batch", "_compute_metrics", "_validate"):
            wrap(trainer_base.PPOTrainer, attr, attr.strip("_"))

    def replay_buffer():
        from verl.trainer.ppo.v1 import replay_buffer as rb

        wrap(rb.ReplayBuffer, "sample", "replay_buffer_sample")
        wrap(rb.ReplayBuffer, "_wait_for_next_poll", "replay_buffer_poll_sleep")
        wrap(rb.ReplayBuffer, "_sync_metadata_from_transfer_queue", "replay_buffer_sync_metadata")

    def checkpoint_engine():
        from verl.checkpoint_engine import base

        for cls in (base.CheckpointEngineManager,):
            wrap(cls, "sleep_replicas", "sleep_replicas")
            wrap(cls, "update_weights", "checkpoint_manager_update_weights")

    def agent_loop():
        from verl.experimental.agent_loop import agent_loop as al

        wrap(al.AgentLoopWorker, "_run_agent_loop", "agent_loop_sample")
        wrap(al.AgentLoopWorker, "_compute_score", "agent_loop_compute_score")
        wrap(al.AgentLoopWorker, "generate_sequences", "agent_loop_worker_generate_sequences")

    def agent_loop_tq():
        # AgentLoopWorkerTQ itself is left alone: a `@ray.remote` class is pickled by value, wrappers and all
        from verl.trainer.ppo.v1 import agent_loop_tq as tq

        wrap(tq.AgentLoopManagerTQ, "generate_sequences", "agent_loop_manager_dispatch")

    def fully_async_trainer():
        from verl.experimental.fully_async_policy import fully_async_trainer as trainer

        wrap(actor_class(trainer.FullyAsyncTrainer), "_fit_update_weights", "fully_async_update_weights")

    def fully_async_rollouter():
        from verl.experimental.fully_async_policy import fully_async_rollouter as rollouter

        wrap(actor_class(rollouter.FullyAsyncRollouter), "reset_staleness", "rollouter_reset_staleness")

    def llm_client():
        from verl.workers.rollout import llm_server

        wrap(llm_server.LLMServerClient, "generate", "llm_client_generate")

    def reward_loop():
        from verl.experimental.reward_loop import reward_loop

        wrap(reward_loop.RewardLoopWorker, "compute_score", "reward_compute_score")

    def cpu_server():
        from async_rl.rollout.cpu import server

        wrap(server.CPURolloutServer, "generate", "server_generate")
        wrap(server.CPURolloutServer, "update_weights", "server_update_weights")
        wrap(server.CPURolloutServer, "sleep", "server_sleep")

    def cpu_engine():
        from async_rl.rollout.cpu import engine

        wrap(engine.ContinuousBatchingEngine, "_forward", "engine_forward", _forward_rows)
        wrap(engine, "decode_forward", "engine_decode")
        wrap(engine, "prefill_forward", "engine_prefill")
        wrap(engine, "sample_tokens", "engine_sample")

    def cpu_adapter():
        from async_rl.rollout.cpu import adapter

        wrap(adapter.CPUServerAdapter, "update_weights", "adapter_update_weights")

    def pipeline_client():
        from async_rl.rollout import agent_loops

        wrap(agent_loops.PipelineLLMClient, "generate", "llm_client_generate")
        wrap(agent_loops.PipelineAgentLoopWorker, "_run_agent_loop", "agent_loop_sample")

    def generate_stage():
        from state_machines import generate

        wrap(generate.GenerateStage, "process_data", "generate_batch")

    def train_stage():
        from state_machines import actor_train

        wrap(actor_train.ActorTrainStage, "_train_step", "train_step")
        wrap(actor_train.ActorTrainStage, "_proximal_log_probs", "pi_prox")

    def reward_stage():
        from state_machines import reward

        wrap(reward.RewardStage, "process_data", "reward_batch")

    def param_update_stage():
        from state_machines import param_update

        wrap(param_update.ParamUpdateStage, "process_data", "param_update")

    def pipeline_calls():
        from async_rl.training import engine_calls

        wrap(engine_calls, "update_actor", "update_actor")
        wrap(engine_calls, "compute_log_prob", "compute_log_prob")

    def pipeline_workers():
        from async_rl.training import workers

        for name in dir(workers):
            cls = getattr(workers, name)
            if isinstance(cls, type) and "send_weight_buckets" in cls.__dict__:
                wrap(cls, "send_weight_buckets", "send_weight_buckets")

    return {
        "state_machines.generate": generate_stage,
        "state_machines.actor_train": train_stage,
        "state_machines.reward": reward_stage,
        "state_machines.param_update": param_update_stage,
        "async_rl.training.engine_calls": pipeline_calls,
        "async_rl.training.workers": pipeline_workers,
        "verl.utils.debug": lambda: _marked_timer(__import__("verl.utils.debug", fromlist=["x"])),
        "verl.trainer.ppo.v1.trainer_base": verl_trainer,
        "verl.trainer.ppo.v1.replay_buffer": replay_buffer,
        "verl.checkpoint_engine.base": checkpoint_engine,
        "verl.experimental.agent_loop.agent_loop": agent_loop,
        "verl.trainer.ppo.v1.agent_loop_tq": agent_loop_tq,
        "verl.workers.rollout.llm_server": llm_client,
        "verl.experimental.fully_async_policy.fully_async_trainer": fully_async_trainer,
        "verl.experimental.fully_async_policy.fully_async_rollouter": fully_async_rollouter,
        "verl.experimental.reward_loop.reward_loop": reward_loop,
        "async_rl.rollout.cpu.server": cpu_server,
        "async_rl.rollout.cpu.engine": cpu_engine,
        "async_rl.rollout.cpu.adapter": cpu_adapter,
        "async_rl.rollout.agent_loops": pipeline_client,
    }


def install() -> None:
    """Wrap the functions above in this process, each when its module is imported (needs `STEP_PARTS_DIR`)."""
    if not os.environ.get(ENV):
        return
    from verl_patches.post_import import when_imported

    for module, patch in _patches().items():
        when_imported(module, patch)
