"""Validation: greedy generation of the validation set on the rollout servers, verl's metrics.

Metrics come from verl's `process_validation_metrics` under verl's names
(`val-core/<data_source>/reward/mean@1`, ...). `trainer.log_val_generations=N` logs N of the
generations (input, output, score) through verl's `ValidationGenerationsLogger` to the backends of
`trainer.logger` that take them (wandb, swanlab, mlflow, trackio, clearml, tensorboard), chosen as verl's
trainer chooses them (`log_val_generations`).
"""

from __future__ import annotations

import asyncio

import numpy as np

from async_rl.core.generation_dumps import GenerationDumps
from async_rl.core.prompts import load_prompt_dataset, tokenize_row
from async_rl.core.reward_loop_scoring import RewardLoopScorer, one_row, uses_reward_loop
from async_rl.core.scoring import ResponseToScore, RewardFunctionError, load_score_fn, score_each_zeroing_failures


def log_val_generations(holder, inputs: list[str], outputs: list[str], scores: list[float], step: int) -> None:
    """verl's trainer's own `_maybe_log_val_generations` (sorted by input, shuffled with seed 42, the first
    `trainer.log_val_generations`, to `validation_generations_logger.log(trainer.logger, samples, step)`),
    run on `holder`: an object with `config` and `validation_generations_logger` (verl's
    `ValidationGenerationsLogger`, which keeps its tables across calls)."""
    from types import SimpleNamespace

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = SimpleNamespace(config=holder.config, validation_generations_logger=holder.validation_generations_logger,
                              global_steps=step)
    RayPPOTrainer._maybe_log_val_generations(trainer, inputs=inputs, outputs=outputs, scores=scores)


class Validator:
    """Scores the policy the rollout servers serve on `data.val_files`."""

    def __init__(self, config, tokenizer, reward_timeout_s: float = 60.0, reward_on_error: str = "stop",
                 generate=None, reward_router: str | None = None, processor=None):
        """``reward_timeout_s`` (s, per sample) and ``reward_on_error`` as for the reward stage
        (`reward.async_timeout_s`, `reward.on_error`). ``generate``: `generate(rows, n, step)`, awaitable, -> the
        Samples of `n` validation trajectories of each row (the generate stage's `run_agent_loops` with
        `validate=True`: verl's agent loops with `val_kwargs` sampling, a lost or hung server restarted and
        its requests resubmitted as in training); set before `run`. ``reward_router``: the reward model's
        router ("ip:port"), when `reward.reward_model.enable`: samples are scored by verl's reward loop, as in
        training. ``processor``: a vision-language model's, for image rows (`model_tokenizer_and_processor`)."""
        self.reward_router = reward_router
        self.reward_loop = reward_router is not None or uses_reward_loop(config)  # scored by verl's reward loop
        self.generate = generate
        self.config = config
        self.reward_timeout_s, self.reward_on_error = reward_timeout_s, reward_on_error
        self.tokenizer = tokenizer
        dataset = load_prompt_dataset(config.data.val_files, config.data, tokenizer, is_train=False,
                                      processor=processor)
        max_len = int(config.data.max_prompt_length)
        truncation, prompt_key = str(config.data.get("truncation", "error")), str(config.data.get("prompt_key", "prompt"))
        self.rows = [tokenize_row(dataset[i], tokenizer, max_len, truncation, config.data.val_files, prompt_key)
                     for i in range(len(dataset))]
        self.score_fn, _ = load_score_fn(config)
        self.n = int(config.actor_rollout_ref.rollout.val_kwargs.get("n", 1))
        self.dumps = GenerationDumps(config.trainer.get("validation_data_dir"))
        from verl.utils.tracking import ValidationGenerationsLogger

        self.validation_generations_logger = ValidationGenerationsLogger(
            project_name=config.trainer.project_name, experiment_name=config.trainer.experiment_name)

    async def _generate_all(self, timeout_s: float, step: int):
        if self.generate is None:
            raise RuntimeError("Validator.generate is not set (the generate stage's run_agent_loops)")
        return await asyncio.wait_for(self.generate([info for _, info in self.rows], self.n, step), timeout=timeout_s)

    def run(self, timeout_s: float, step: int = 0) -> dict[str, float]:
        """Validation metrics of the served policy; with `trainer.validation_data_dir`, also verl's
        `{step}.jsonl` dump of every generation."""
        from verl.trainer.ppo.metric_utils import process_validation_metrics

        outputs = asyncio.run(self._generate_all(timeout_s, step))
        sources, uids, texts, responses, rows = [], [], [], [], []
        for j, out in enumerate(outputs):
            _, info = self.rows[j // self.n]
            texts.append(self.tokenizer.decode(out.response_ids, skip_special_tokens=True))
            responses.append(ResponseToScore(info["data_source"], texts[-1], info["reward_model"]["ground_truth"],
                                             info.get("extra_info"), len(out.response_ids)))
            rows.append((out.prompt_ids, out.response_ids, info))
            sources.append(info["data_source"])
            uids.append(str(j // self.n))
        if self.reward_loop:
            scored, failures = asyncio.run(self._score_with_reward_model(rows))
        else:
            scored, failures = asyncio.run(score_each_zeroing_failures(responses, self.score_fn, None,
                                                                       self.reward_timeout_s))
        if failures and self.reward_on_error == "stop":
            row, cause = failures[0]
            scorer = "the reward model" if self.reward_router is not None else "the reward function"
            raise RewardFunctionError(f"validation at step {step}: {scorer} failed on sample {row}: "
                                      f"{cause} (reward.on_error=zero scores such samples 0 instead)")
        scores = scored.tolist()
        nested = process_validation_metrics(sources, uids, {"reward": scores})
        metrics = {}
        for source, var2metric in nested.items():
            for var, metric2val in var2metric.items():
                n_max = max(int(name.split("@")[-1].split("/")[0]) for name in metric2val)
                for name, value in metric2val.items():
                    core = name.startswith(("mean", "maj", "best")) and f"@{n_max}" in name
                    metrics[f"{'val-core' if core else 'val-aux'}/{source}/{var}/{name}"] = float(value)
        metrics["val-aux/reward/mean"] = float(np.mean(scores)) if scores else float("nan")
        inputs = [self.tokenizer.decode(self.rows[j // self.n][0], skip_special_tokens=True) for j in range(len(texts))]
        log_val_generations(self, inputs, texts, scores, step)
        self._dump(step, inputs, texts, scores)
        return metrics

    async def _score_with_reward_model(self, rows: list):
        scorer = RewardLoopScorer(self.config, self.reward_router)  # in this loop: verl's managers keep it
        return await scorer.score([one_row(*row) for row in rows], self.reward_timeout_s)

    def _dump(self, step: int, inputs: list[str], outputs: list[str], scores: list[float]) -> None:
        if self.dumps.directory is None:
            return
        gts = [self.rows[j // self.n][1]["reward_model"].get("ground_truth") for j in range(len(outputs))]
        self.dumps.write(step, inputs, outputs, gts, scores)
        self.dumps.flush()
