"""`trainer.log_val_generations=N`: validation logs N of its generations through verl's
`ValidationGenerationsLogger`, the N verl's trainer picks (sorted by input, shuffled with seed 42), to the
backends of `trainer.logger`; with `tensorboard` verl's logger writes them as text. No Ray: the validator
runs on generations given here."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from helpers.lineage import compose_ppo

N = 3


def validator_on(demo_dir, extra: dict):
    """The pipeline's Validator on the demo's validation set, each row answered by a fixed response."""
    from async_rl.core.config import strip_async_keys
    from async_rl.demo import demo_overrides
    from async_rl.validation import Validator

    config = compose_ppo(demo_overrides(demo_dir, extra=extra))
    strip_async_keys(config)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")

    async def generate(rows, n, step):  # row i answers "i % 10" four times: a score of 1 where that is the answer
        answers = [tokenizer.encode(str(i % 10) * 4) for i in range(len(rows)) for _ in range(n)]
        return [SimpleNamespace(prompt_ids=[1], response_ids=ids) for ids in answers]

    return Validator(config, tokenizer, 30.0, generate=generate), tokenizer


class RecordingLogger:
    def __init__(self):
        self.calls = []

    def log(self, loggers, samples, step):
        self.calls.append((list(loggers), samples, step))


def test_n_validation_generations_go_to_verls_logger_as_verls_trainer_picks_them(demo_dir):
    validator, tokenizer = validator_on(demo_dir, {"trainer.log_val_generations": N,
                                                   "trainer.logger": ["console", "wandb"]})
    recorder = RecordingLogger()
    validator.validation_generations_logger = recorder
    metrics = validator.run(timeout_s=60, step=4)
    assert len(recorder.calls) == 1
    loggers, samples, step = recorder.calls[0]
    assert loggers == ["console", "wandb"] and step == 4
    everything = sorted(
        (tokenizer.decode(ids, skip_special_tokens=True), str(i % 10) * 4, info["reward_model"]["ground_truth"])
        for i, (ids, info) in enumerate(validator.rows))
    np.random.RandomState(42).shuffle(everything)
    want = everything[:N]
    assert [(s[0], s[1]) for s in samples] == [(w[0], w[1]) for w in want]
    for (_, output, score), (_, _, truth) in zip(samples, want):  # the demo's per-position score
        assert score == pytest.approx(sum(a == b for a, b in zip(output, str(truth))) / 4)
    assert metrics["val-aux/reward/mean"] >= 0
    validator.config.trainer.log_val_generations = 0  # verl's default: nothing logged
    validator.run(timeout_s=60, step=5)
    assert len(recorder.calls) == 1


def test_with_tensorboard_verls_logger_writes_the_generations(demo_dir, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    validator, _ = validator_on(demo_dir, {"trainer.log_val_generations": N,
                                           "trainer.logger": ["console", "tensorboard"]})
    validator.run(timeout_s=60, step=2)
    validator.validation_generations_logger.writer.flush()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    (tag,) = events.Tags()["tensors"]
    (event,) = events.Tensors(tag)
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2 and "Generation Results - Step 2" in text and text.count("**Score:**") == N
