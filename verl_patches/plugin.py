"""The `verl.plugins` entry point: `import verl` loads this module in every process.

It does one cheap thing: it wraps `verl.utils.config.validate_config`, which
`verl.trainer.main_ppo.main` calls before it dispatches. With
`+actor_rollout_ref.async_pipeline=True` the wrapper validates the pipeline's keys
(failing before Ray starts) and points the caller's `run_ppo` at `async_rl.pipeline.run_async_pipeline`. Without the flag it calls
verl's function unchanged, so verl behaves as if this package were absent. (The CPU
rollout backend `cpu` is registered in verl's `RolloutReplicaRegistry` by the pipeline
when it starts, `async_rl.rollout_backends`.)
"""

from __future__ import annotations

import functools
import sys

_WRAPPED_MARK = "_async_rl_wrapped"


def enter_async_pipeline(config, caller_globals: dict) -> None:
    """Validate the pipeline keys and redirect the caller's `run_ppo` to the pipeline."""
    from async_rl.pipeline import run_async_pipeline, validate_pipeline_config

    validate_pipeline_config(config)
    if "run_ppo" not in caller_globals:
        raise RuntimeError(
            "actor_rollout_ref.async_pipeline=True is handled for `python -m verl.trainer.main_ppo`; "
            "from your own script call async_rl.pipeline.AsyncPipeline(config).run()"
        )
    caller_globals["run_ppo"] = run_async_pipeline


def wrap_validate_config() -> None:
    """Install the `validate_config` wrapper (idempotent)."""
    import verl.utils.config as config_module

    original = config_module.validate_config
    if getattr(original, _WRAPPED_MARK, False):
        return

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        from async_rl.config import async_pipeline_enabled

        if async_pipeline_enabled(config):
            enter_async_pipeline(config, sys._getframe(1).f_globals)
        return original(config, *args, **kwargs)

    setattr(validate_config, _WRAPPED_MARK, True)
    config_module.validate_config = validate_config


wrap_validate_config()
