"""Pick `trainer.use_nodes_ratios` for a cluster from a short run's metrics: `python -m async_rl.plan`.

    python -m async_rl.plan --metrics RUN.jsonl --nodes N --gpus-per-node G [--replica-devices 1] [--top 5]

The model, in seconds (s) and device-seconds per training step (one `timing_s/step`):
- a stage on devices does W = busy_ratio x step s x its devices (`async/<stage>/busy_ratio`, `async/devices/*`),
  W / n s on n devices (training roles x `efficiency` per doubling above `ref_devices`; measured: linear);
  the train ranks add the weight gather (`timing_s/gather_weights`, s whatever the devices). Stages on no
  devices (dataloader, rollout, reward, param_update, user stages) take their busy s.
- async step: the larger of a throughput bound (the busiest device, where sharing roles' times add, or fixed
  stage) and a latency bound: batch j starts generating once batch j - k has trained (k = generate_ahead_steps),
  so k steps cover a batch's way: generation (at least `tail_s`, the longest response's decode) + rollout +
  the slowest of logp/ref_logp/reward + the update and gather + param_update.
- sync step (verl's schedule): generation max(W / T, tail_s), each training role on all T devices, the gather
  and the fixed stages but rollout and param_update (the pipeline's own), one after another.
- bubble: 1 - busy device-s / (devices x step s). Roles sharing devices in the run contended: W includes it.
"""

from async_rl.plan.model import (RATIO_ROLES, SERIAL, PlanError, Workload, candidates, devices_text, devices_used,
                                 predict, ratio_of, read_run, sync_step)

__all__ = ["RATIO_ROLES", "SERIAL", "PlanError", "Workload", "candidates", "devices_text", "devices_used", "predict", "ratio_of",
           "read_run", "sync_step"]
