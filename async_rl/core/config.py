"""The pipeline's config keys: one table (`KEYS`: key, default, check, allowed, meaning) from which
the defaults of `AsyncPipelineConfig`, the validation and the README's table come
(tests/core/test_config.py checks the README against it).

Every key is added to a verl command with `+` (verl's schema does not know them). Validation runs
in the driver before any Ray actor starts and raises `AsyncConfigError` with one message naming
the key, the value and what is allowed. verl's own checkpoint keys are checked by
async_rl/checkpoints.py; whether a run has a critic is verl's own rule (`critic_enabled`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from async_rl.core.decoupled_ppo import PROXIMAL_LOGP_METHODS, conflicting_settings
from async_rl.core.errors import AsyncConfigError
from async_rl.core.stage_graph import STAGES_KEY, parse_user_stages

USE_NODES_ROLES = ("train", "logp", "ref_logp", "generate")
CRITIC_ROLE = "critic"  # the optional 5th number of use_nodes_ratios (default: the train ratio)
# Where pi_prox (verl's recomputed old_log_probs) is computed: "train" on the train ranks right
# before their update (no weight hop, logp and train cannot take turns), "logp" on the logp
# stage's own worker group, which then receives every version through the weight sync.
PROXIMAL_LOGP_WORKERS = ("train", "logp")
PREDUCE_BUCKET_KEY = "actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb"
CONSUME_BUCKET_KEY = "actor_rollout_ref.rollout.param_update_consume_bucket_size_mb"
DELTA_SYNC_KEY = "actor_rollout_ref.rollout.param_update_delta_sync"
MB = 1 << 20  # the bucket sizes' unit
STAGE_PROCESSES = ("per_node", "per_stage")  # the stages of a node share one Ray actor process, or not
REWARD_ON_ERROR = ("stop", "zero")  # a raising / hanging reward function: fail the run, or score 0 and count

logger = logging.getLogger(__name__)


def select_value(config, key: str, default):
    value = OmegaConf.select(config, key, default=default) if isinstance(config, DictConfig) else default
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    return value


def _as_bool(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    raise AsyncConfigError(key, value, "true or false")


FLAG_KEY = "actor_rollout_ref.async_pipeline"
# the flag as Hydra users type it: Hydra reads `=true` as a bool, `=1` as an int, `=yes` / `=on` as strings
FLAG_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
FLAG_ALLOWED = "true or false (also 1 / 0, yes / no, on / off, in any case)"


def _as_flag(key: str, value) -> bool:
    """`actor_rollout_ref.async_pipeline`: True or False as any of FLAG_WORDS spells it; anything else raises."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1) or isinstance(value, str) and value.strip().lower() in FLAG_WORDS:
        return FLAG_WORDS[str(value).strip().lower()]
    raise AsyncConfigError(key, value, FLAG_ALLOWED)


def _as_positive_number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise AsyncConfigError(key, value, "a number > 0")
    return float(value)


def _as_ratios(key: str, value) -> tuple[float, ...]:
    allowed = (f"a list of {len(USE_NODES_ROLES)} numbers in (0, 1] for {list(USE_NODES_ROLES)}, "
               f"or 5 with the {CRITIC_ROLE}'s last")
    if not isinstance(value, (list, tuple)) or len(value) not in (len(USE_NODES_ROLES), len(USE_NODES_ROLES) + 1):
        raise AsyncConfigError(key, value, allowed)
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise AsyncConfigError(key, value, allowed)
    return tuple(float(v) for v in value)


def _as_ahead_steps(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AsyncConfigError(key, value, "an integer >= 1 (1 = synchronous on-policy, 2 = one-step-off)")
    return value


def _as_count(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise AsyncConfigError(key, value, "an integer >= 0")
    return value


def _as_cap(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 1:
        raise AsyncConfigError(key, value, "a number > 1 (AReaL's behav_imp_weight_cap)")
    return float(value)


def _as_choice(key: str, value, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise AsyncConfigError(key, value, " or ".join(choices))
    return value


def _as_reward_on_error(key: str, value) -> str:
    return _as_choice(key, value, REWARD_ON_ERROR)


def _as_stage_processes(key: str, value) -> str:
    return _as_choice(key, value, STAGE_PROCESSES)


def _as_proximal_workers(key: str, value) -> str:
    return _as_choice(key, value, PROXIMAL_LOGP_WORKERS)


def _as_proximal_method(key: str, value) -> str:
    return _as_choice(key, value, PROXIMAL_LOGP_METHODS)


def _as_optional_count(key: str, value) -> Optional[int]:
    return None if value is None else _as_count(key, value)


def _as_optional_path(key: str, value) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise AsyncConfigError(key, value, "a directory path, or null for none")
    return value


def _as_optional_pool_size(key: str, value) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AsyncConfigError(key, value, "an integer >= 1, or null for no limit")
    return value


@dataclass(frozen=True)
class Key:
    """One config key. `check(key, value)` returns the validated value or raises AsyncConfigError
    (None: checked on its own); `allowed` and `meaning` are the README table's columns (markdown);
    `default_text` replaces the default there when it is not a plain value."""

    key: str
    field: str
    default: Any
    check: Optional[Callable[[str, Any], Any]]
    allowed: str
    meaning: str
    default_text: str = ""

    @property
    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        value = list(self.default) if isinstance(self.default, tuple) else self.default
        return f"`{str(value).replace(' ', '') if isinstance(value, list) else value}`"


KEYS = (
    Key(FLAG_KEY, "enabled", False, _as_flag, "bool",  # also 1/0, yes/no, on/off (docs/using_with_verl.md)
        "run the async pipeline instead of verl's trainer"),
    Key("trainer.use_nodes_ratios", "use_nodes_ratios", (0.5, 0.5, 0.5, 0.5), _as_ratios,
        "4 or 5 numbers in (0, 1]",
        "share of `nnodes x n_gpus_per_node` for train, logp, ref_logp, generate (5th: critic, default train's); "
        "[docs/placement.md](docs/placement.md)"),
    Key("actor_rollout_ref.rollout.enable_dual_buffer", "enable_dual_buffer", True, _as_bool, "bool",
        "receivers stage the next version in a second buffer"),
    Key(PREDUCE_BUCKET_KEY, "preduce_bucket_size_mb", 512.0,
        _as_positive_number, "> 0", "MB per bucket when gathering weights on the trainer", "`512`"),
    Key(CONSUME_BUCKET_KEY, "consume_bucket_size_mb", 128.0,
        _as_positive_number, "> 0", "MB per bucket when loading weights into the engine", "`128`"),
    Key(DELTA_SYNC_KEY, "delta_sync", False, _as_bool, "bool",
        "versions carry only the values that changed ([docs](docs/weight_sync.md#delta-sync))"),
    Key("trainer.generate_ahead_steps", "generate_ahead_steps", 2, _as_ahead_steps, "int >= 1",
        "k: staleness bound eta = k - 1 (1 = synchronous on-policy, 2 = one-step-off)"),
    Key("trainer.async_stall_timeout_s", "stall_timeout_s", 600.0, _as_positive_number, "> 0",
        "no training step for this long stops the run with every stage's state", "`600`"),
    Key("trainer.async_trace_path", "trace_path", None, _as_optional_path, "a directory",
        "the run's timeline `trace.json` (Perfetto) and `report.html` ([docs](docs/metrics.md#timeline))", "none"),
    Key("trainer.stop_deadline_s", "stop_deadline_s", 25.0, _as_positive_number, "> 0",
        "SIGTERM/SIGINT to the job: last step saved, every process gone within this "
        "([docs](docs/operations.md))", "`25`"),
    Key("trainer.stage_processes", "stage_processes", "per_node", _as_stage_processes, "`per_node` or `per_stage`",
        "a node's stages share one Ray actor process, or each has its own "
        "([docs](docs/architecture.md#stage-processes))"),
    Key("reward.async_timeout_s", "reward_timeout_s", 60.0, _as_positive_number, "> 0",
        "one batch's reward scoring may take this long; a hanging reward function fails the run, named", "`60`"),
    Key("trainer.max_restarts", "max_restarts", 0, _as_count, "int >= 0",
        "a stage failing mid-run restarts the pipeline from the newest checkpoint, up to N times "
        "(`async/faults/pipeline_restarts`)"),
    Key("reward.on_error", "reward_on_error", "stop", _as_reward_on_error, "`stop` or `zero`",
        "a reward function that raises or hangs: stop the run naming it, or score it 0, counted "
        "(`async/faults/reward_errors`)"),
    Key(STAGES_KEY, "user_stages", None, None, "name -> `{cls, after, kwargs}`",
        "your own stages, each after an existing one (\"Writing a stage\")", "`{}`"),
    Key("algorithm.decoupled_ppo", "decoupled_ppo", True, _as_bool, "bool",
        "AReaL's decoupled PPO through verl's rollout correction"),
    Key("algorithm.behav_imp_weight_cap", "behav_imp_weight_cap", 5.0, _as_cap, "> 1",
        "tokens whose pi_prox / pi_behav exceeds it get weight 0 (AReaL's cap)"),
    Key("actor_rollout_ref.rollout.partial_rollout", "partial_rollout", True, _as_bool, "bool",
        "a weight load interrupts running requests, which go on under the new weights; `False`: it waits for "
        "them (cpu, vllm)"),
    Key("algorithm.proximal_logp_workers", "proximal_logp_workers", "train", _as_proximal_workers,
        "`train` or `logp`",
        "where pi_prox (verl's `old_log_probs`) is recomputed: the train ranks, or the logp stage's"),
    Key("algorithm.proximal_logp_method", "proximal_logp_method", "recompute", _as_proximal_method,
        "`recompute`, `loglinear`, `update_forward`", "pi_prox by its own forward pass, interpolated (AReaL's) or "
        "the update's forward (exact with one optimizer step; [docs](docs/algorithms.md#decoupled-ppo))"),
    Key("actor_rollout_ref.rollout.max_restarts", "replica_max_restarts", None, _as_optional_count, "int >= 0",
        "restarts of each lost rollout (or reward-model) replica over the run; `0` stops the run naming it; "
        "above 0 with `cpu` or `vllm`", "`3` with `rollout.name=cpu`, else `0`"),
    Key("actor_rollout_ref.rollout.request_timeout_s", "request_timeout_s", 600.0, _as_positive_number, "> 0",
        "a request unanswered this long marks its server lost (killed, restarted)", "`600`"),
    Key("actor_rollout_ref.rollout.multi_turn.tool_timeout_s", "tool_timeout_s", 120.0, _as_positive_number, "> 0",
        "an agent loop's tool call unanswered this long ends in an error the model reads, naming this key",
        "`120`"),
    Key("actor_rollout_ref.rollout.multi_turn.tool_pool_size", "tool_pool_size", None, _as_optional_pool_size,
        "int >= 1", "each tool's environments in use at once; a wait past "
        "`tool_timeout_s` fails the call ([docs](docs/agent_loops.md#environment-pool))", "none"),
)
CONFIG_KEYS = tuple(k.key for k in KEYS)
_DEFAULTS = {k.field: k.default for k in KEYS}


@dataclass(frozen=True)
class AsyncPipelineConfig:
    """The pipeline's own settings, validated (`read_async_config`); defaults from `KEYS`."""

    enabled: bool = _DEFAULTS["enabled"]
    use_nodes_ratios: tuple[float, ...] = _DEFAULTS["use_nodes_ratios"]
    enable_dual_buffer: bool = _DEFAULTS["enable_dual_buffer"]
    preduce_bucket_size_mb: float = _DEFAULTS["preduce_bucket_size_mb"]
    consume_bucket_size_mb: float = _DEFAULTS["consume_bucket_size_mb"]
    delta_sync: bool = _DEFAULTS["delta_sync"]
    generate_ahead_steps: int = _DEFAULTS["generate_ahead_steps"]
    stall_timeout_s: float = _DEFAULTS["stall_timeout_s"]
    stop_deadline_s: float = _DEFAULTS["stop_deadline_s"]  # first stop signal -> process exit
    stage_processes: str = _DEFAULTS["stage_processes"]  # per_node: one StageHost per node
    trace_path: Optional[str] = _DEFAULTS["trace_path"]  # the timeline's folder (None: no timeline)
    reward_timeout_s: float = _DEFAULTS["reward_timeout_s"]
    reward_on_error: str = _DEFAULTS["reward_on_error"]
    max_restarts: int = _DEFAULTS["max_restarts"]  # whole-pipeline restarts after a stage fails mid-run
    user_stages: tuple = ()  # async_rl.core.stage_graph.UserStageSpec, in insertion order
    decoupled_ppo: bool = _DEFAULTS["decoupled_ppo"]
    behav_imp_weight_cap: float = _DEFAULTS["behav_imp_weight_cap"]
    partial_rollout: bool = _DEFAULTS["partial_rollout"]
    proximal_logp_workers: str = _DEFAULTS["proximal_logp_workers"]
    proximal_logp_method: str = _DEFAULTS["proximal_logp_method"]
    replica_max_restarts: Optional[int] = _DEFAULTS["replica_max_restarts"]  # None: the rollout backend's default
    request_timeout_s: float = _DEFAULTS["request_timeout_s"]
    tool_timeout_s: float = _DEFAULTS["tool_timeout_s"]
    tool_pool_size: Optional[int] = _DEFAULTS["tool_pool_size"]
    ratios_by_role: dict = field(default_factory=dict)  # role -> its share of the devices (derived)
    dynamic_sampling: bool = False  # verl's algorithm.filter_groups.enable (derived)

    @property
    def max_staleness(self) -> int:
        """eta: how many versions older than the trainer a trained sample may be."""
        return self.generate_ahead_steps - 1


def readme_table() -> str:
    """The README's configuration table, from `KEYS`."""
    rows = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    rows += [f"| `{k.key}` | {k.shown_default} | {k.allowed} | {k.meaning} |" for k in KEYS]
    return "\n".join(rows)


def decoupled_ppo_setting(config, value):
    """`algorithm.decoupled_ppo` as the run takes it (`value`: as read, the default when absent). A command
    that sets verl's `algorithm.rollout_correction` itself gets verl's rollout correction as set: the
    default turns off, and the log says so; `decoupled_ppo=True` set beside it is refused naming both."""
    rollout_correction = OmegaConf.select(config, "algorithm.rollout_correction") if isinstance(config, DictConfig) else None
    conflicts = conflicting_settings(rollout_correction)
    if not conflicts or value is not True:
        return value
    given = ", ".join(f"algorithm.rollout_correction.{k}={v!r}" for k, v in conflicts.items())
    if select_value(config, "algorithm.decoupled_ppo", None) is not None:
        raise AsyncConfigError(
            "algorithm.decoupled_ppo", True,
            f"False or unset when {given} is set (decoupled PPO writes algorithm.rollout_correction itself)",
        )
    logger.warning("%s set by the command: verl's rollout correction as set, not AReaL's decoupled PPO "
                   "(+algorithm.decoupled_ppo=False implied)", given)
    return False


def critic_enabled(config) -> bool:
    """verl's rule (`verl.trainer.ppo.utils.need_critic`): `critic.enable` when set, else whether the
    estimator is gae. gae with `critic.enable=False` is refused naming both keys (verl's step would
    find no values)."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator

    enable = select_value(config, "critic.enable", None)
    estimator = select_value(config, "algorithm.adv_estimator", None)
    if enable is False and estimator == AdvantageEstimator.GAE.value:
        raise AsyncConfigError("critic.enable", False, "null or True with algorithm.adv_estimator=gae "
                               "(gae needs the critic's values)")
    if enable is not None:
        return bool(enable)
    return estimator == AdvantageEstimator.GAE.value


FILTER_GROUPS_METRICS = ("reward", "acc", "score", "seq_reward", "seq_final_reward")  # one sequence score here


def dynamic_sampling_enabled(config) -> bool:
    """verl's DAPO dynamic sampling key, `algorithm.filter_groups.enable` (validated)."""
    if select_value(config, "algorithm.filter_groups.enable", False) is not True:
        return False
    metric = select_value(config, "algorithm.filter_groups.metric", None)
    if metric is not None and metric not in FILTER_GROUPS_METRICS:
        raise AsyncConfigError("algorithm.filter_groups.metric", metric, f"null or one of {list(FILTER_GROUPS_METRICS)}")
    bound = select_value(config, "algorithm.filter_groups.max_num_gen_batches", 0)
    if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
        raise AsyncConfigError("algorithm.filter_groups.max_num_gen_batches", bound, "an integer >= 0 (0: no bound)")
    return True


def read_async_config(config) -> AsyncPipelineConfig:
    """Read and validate the pipeline's keys (`KEYS`) from a verl config; raises AsyncConfigError.
    `replica_max_restarts` stays None when unset: its default is the rollout backend's."""
    raw = {k.field: select_value(config, k.key, k.default) for k in KEYS}
    raw["decoupled_ppo"] = decoupled_ppo_setting(config, raw["decoupled_ppo"])
    user_stages = parse_user_stages(raw["user_stages"])
    dynamic_sampling = dynamic_sampling_enabled(config)
    values = {k.field: k.check(k.key, raw[k.field]) for k in KEYS if k.check is not None}
    return AsyncPipelineConfig(**values, user_stages=user_stages, dynamic_sampling=dynamic_sampling,
                               ratios_by_role=role_ratios(values["use_nodes_ratios"]))


def role_ratios(ratios: tuple[float, ...]) -> dict[str, float]:
    """Role -> its share of the devices, from `use_nodes_ratios` (the critic's: the 5th number, else train's)."""
    return {**dict(zip(USE_NODES_ROLES, ratios)), CRITIC_ROLE: ratios[4] if len(ratios) > 4 else ratios[0]}


def strip_async_keys(config: DictConfig) -> None:
    """Remove the pipeline's keys from a verl config (in place) once read.

    verl turns sections such as `actor_rollout_ref.rollout` into dataclasses that reject
    unknown fields, so the keys must not reach verl's workers.
    """
    for key in CONFIG_KEYS:
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(config, parent_key)
        if isinstance(parent, DictConfig) and leaf in parent:
            with open_dict(parent):
                parent.pop(leaf)


CPU_DEVICE = "cpu"  # `trainer.device` of a run on CPU: its devices are worker processes


def runs_on_cpu(config) -> bool:
    """`trainer.device=cpu` (a verl config, or a plain mapping of one)."""
    return str((config.get("trainer") or {}).get("device", "")) == CPU_DEVICE


def async_pipeline_enabled(config) -> bool:
    """Whether the user asked for the pipeline (`+actor_rollout_ref.async_pipeline=True`, or 1 / yes / on);
    False when the key is absent. Any value but those of `FLAG_WORDS` raises AsyncConfigError naming it."""
    return _as_flag(FLAG_KEY, select_value(config, FLAG_KEY, False))
