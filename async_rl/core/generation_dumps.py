"""verl's generation dumps: `trainer.rollout_data_dir` and `trainer.validation_data_dir`.

One `{step}.jsonl` per training step (the rows it trained) or validation, with verl's
fields `input`, `output`, `gts`, `score`, `step` (plus `uid`), written by verl's own writer
(`RayPPOTrainer._write_generations`) on a background thread, as verl's trainer does.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional


class GenerationDumps:
    """Writes `{step}.jsonl` files under `directory` (None: writes nothing)."""

    def __init__(self, directory: Optional[str]):
        self.directory = directory
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generation-dump") if directory else None
        self._futures: list[Future] = []

    def write(self, step: int, inputs: list[str], outputs: list[str], gts: list, scores: list[float],
              extra: Optional[dict[str, list]] = None) -> None:
        """Queue `{step}.jsonl`; raises the error of an earlier write that failed."""
        if self._executor is None:
            return
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        self._futures.append(self._executor.submit(
            RayPPOTrainer._write_generations, inputs, outputs, gts, scores, extra or {}, self.directory, step
        ))
        for future in [f for f in self._futures if f.done()]:
            self._futures.remove(future)
            future.result()

    def flush(self) -> None:
        """Wait for every queued write (raises a failed one's error)."""
        if self._executor is None:
            return
        for future in self._futures:
            future.result()
        self._futures.clear()

    def write_batch(self, step: int, batch, tokenizer, scores) -> None:
        """The rows of a verl batch: prompts and responses decoded as verl's trainer decodes them."""
        if self._executor is None:
            return
        inputs = tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
        outputs = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
        gts = [(info or {}).get("ground_truth") for info in batch.non_tensor_batch.get("reward_model", [None] * len(batch))]
        self.write(step, inputs, outputs, gts, [float(s) for s in scores],
                   {"uid": [str(u) for u in batch.non_tensor_batch["uid"]]})
