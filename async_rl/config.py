"""The pipeline's config keys: defaults, reading from verl's config, fail-fast validation.

Every key is added to a verl command with `+` (verl's schema does not know them):

| key | default | allowed |
|---|---|---|
| actor_rollout_ref.async_pipeline | False | bool |
| trainer.use_nodes_ratios | [0.5, 0.5, 0.5, 0.5] | 4 numbers in (0, 1]: train, logp, ref_logp, generate; a 5th: critic (default: train's) |
| actor_rollout_ref.rollout.enable_dual_buffer | True | bool |
| actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb | 512 | number > 0 (MB) |
| actor_rollout_ref.rollout.param_update_consume_bucket_size_mb | 128 | number > 0 (MB) |
| trainer.generate_ahead_steps | 2 | int >= 1 (k; staleness bound eta = k - 1) |
| trainer.async_stall_timeout_s | 600 | number > 0: no step for this long fails the run |
| reward.async_timeout_s | 60 | number > 0: one reward call may take this long |
| trainer.max_restarts | 0 | int >= 0: a stage failing mid-run restarts the whole pipeline from the newest checkpoint, up to N times |
| reward.on_error | stop | stop or zero: a reward function that raises or hangs stops the run, or scores that sample 0 |
| trainer.async_stages | {} | name -> {cls, after, kwargs}: user stages (async_rl/stage_graph.py) |
| algorithm.decoupled_ppo | True | bool: AReaL's decoupled PPO via verl's rollout correction (async_rl/decoupled_ppo.py) |
| algorithm.behav_imp_weight_cap | 5.0 | number > 1: tokens with pi_prox / pi_behav above it get weight 0 |
| actor_rollout_ref.rollout.partial_rollout | True | bool: a weight load interrupts requests (False: it waits for them) |
| algorithm.proximal_logp_workers | train | train or logp: which workers recompute pi_prox (old_log_probs) |
| actor_rollout_ref.rollout.max_restarts | 3 (cpu), 0 (vllm) | int >= 0: restarts of each lost rollout replica over the run; > 0 with rollout.name cpu or vllm |
| actor_rollout_ref.rollout.request_timeout_s | 600 | number > 0: a generate request unanswered this long marks its server lost |

Validation runs in the driver before any Ray actor starts and raises
`AsyncConfigError` with one message naming the key, the value and what is allowed.
verl's checkpoint keys are read and checked by async_rl/checkpoints.py; whether a run has a
critic is verl's own rule (`critic_enabled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from async_rl.config_error import AsyncConfigError
from async_rl.stage_graph import STAGES_KEY, parse_user_stages

USE_NODES_ROLES = ("train", "logp", "ref_logp", "generate")
CRITIC_ROLE = "critic"  # the optional 5th number of use_nodes_ratios (default: the train ratio)


@dataclass(frozen=True)
class AsyncPipelineConfig:
    """The pipeline's own settings, validated."""

    enabled: bool = False
    use_nodes_ratios: tuple[float, ...] = (0.5, 0.5, 0.5, 0.5)
    enable_dual_buffer: bool = True
    preduce_bucket_size_mb: float = 512.0
    consume_bucket_size_mb: float = 128.0
    generate_ahead_steps: int = 2
    stall_timeout_s: float = 600.0
    reward_timeout_s: float = 60.0
    reward_on_error: str = "stop"  # REWARD_ON_ERROR
    max_restarts: int = 0  # whole-pipeline restarts from the newest checkpoint after a stage fails mid-run
    ratios_by_role: dict = field(default_factory=dict)
    user_stages: tuple = ()  # async_rl.stage_graph.UserStageSpec, in insertion order
    decoupled_ppo: bool = True
    behav_imp_weight_cap: float = 5.0
    partial_rollout: bool = True
    dynamic_sampling: bool = False  # verl's algorithm.filter_groups.enable
    proximal_logp_workers: str = "train"  # PROXIMAL_LOGP_WORKERS
    replica_max_restarts: int = 0  # restarts of each lost rollout replica (async_rl/replica_supervisor.py)
    request_timeout_s: float = 600.0  # a generate request unanswered this long (s) marks its server lost

    @property
    def max_staleness(self) -> int:
        """eta: how many versions older than the trainer a trained sample may be."""
        return self.generate_ahead_steps - 1


DEFAULT_REPLICA_RESTARTS = 3  # on rollout.name=cpu; 0 on vllm (opt in: it keeps a weight copy)
# Where pi_prox (verl's recomputed old_log_probs) is computed: "train" on the train ranks right
# before their update (no weight hop, logp and train cannot take turns), "logp" on the logp
# stage's own worker group, which then receives every version through the weight sync.
PROXIMAL_LOGP_WORKERS = ("train", "logp")
REWARD_ON_ERROR = ("stop", "zero")  # a raising / hanging reward function: fail the run, or score 0 and count


def select_value(config, key: str, default):
    value = OmegaConf.select(config, key, default=default) if isinstance(config, DictConfig) else default
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    return value


def _as_bool(key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    raise AsyncConfigError(key, value, "true or false")


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


def _check_decoupled(config, enabled: bool) -> None:
    """Decoupled PPO writes verl's rollout_correction; refuse to overwrite the user's own settings."""
    from async_rl.decoupled_ppo import conflicting_settings

    rollout_correction = OmegaConf.select(config, "algorithm.rollout_correction") if isinstance(config, DictConfig) else None
    conflicts = conflicting_settings(rollout_correction) if enabled else {}
    if conflicts:
        given = ", ".join(f"algorithm.rollout_correction.{k}={v!r}" for k, v in conflicts.items())
        raise AsyncConfigError(
            "algorithm.decoupled_ppo", True,
            f"False when {given} is set (decoupled PPO sets algorithm.rollout_correction itself)",
        )


RESTARTABLE_ROLLOUTS = ("cpu", "vllm")  # sglang's servers: restart not written yet


def _replica_restarts(key: str, value, rollout_name) -> int:
    """Restarts of a lost rollout replica: the CPU backend's servers and verl's vLLM replicas (its
    workers and servers started again on the same devices). Default 3 on cpu; 0 on vllm, where a
    restart needs a copy of the newest weights kept in Ray's object store (opt in)."""
    if value is None:
        return DEFAULT_REPLICA_RESTARTS if rollout_name == "cpu" else 0
    value = _as_count(key, value)
    if value and rollout_name not in RESTARTABLE_ROLLOUTS:
        raise AsyncConfigError(key, value, f"0 with actor_rollout_ref.rollout.name={rollout_name!r} (restarting "
                                           f"a lost replica is supported for rollout.name in {RESTARTABLE_ROLLOUTS})")
    return value


# (dotted key, dataclass field, default, check(key, value) -> the value; None: checked on its own)
_KEYS = (
    ("actor_rollout_ref.async_pipeline", "enabled", False, _as_bool),
    ("trainer.use_nodes_ratios", "use_nodes_ratios", [0.5, 0.5, 0.5, 0.5], _as_ratios),
    ("actor_rollout_ref.rollout.enable_dual_buffer", "enable_dual_buffer", True, _as_bool),
    ("actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb", "preduce_bucket_size_mb", 512,
     _as_positive_number),
    ("actor_rollout_ref.rollout.param_update_consume_bucket_size_mb", "consume_bucket_size_mb", 128,
     _as_positive_number),
    ("trainer.generate_ahead_steps", "generate_ahead_steps", 2, _as_ahead_steps),
    ("trainer.async_stall_timeout_s", "stall_timeout_s", 600, _as_positive_number),
    ("reward.async_timeout_s", "reward_timeout_s", 60, _as_positive_number),
    ("reward.on_error", "reward_on_error", "stop", lambda key, value: _as_choice(key, value, REWARD_ON_ERROR)),
    ("trainer.max_restarts", "max_restarts", 0, _as_count),
    ("algorithm.decoupled_ppo", "decoupled_ppo", True, _as_bool),
    ("algorithm.behav_imp_weight_cap", "behav_imp_weight_cap", 5.0, _as_cap),
    ("actor_rollout_ref.rollout.partial_rollout", "partial_rollout", True, _as_bool),
    ("algorithm.proximal_logp_workers", "proximal_logp_workers", "train",
     lambda key, value: _as_choice(key, value, PROXIMAL_LOGP_WORKERS)),
    ("actor_rollout_ref.rollout.max_restarts", "replica_max_restarts", None, None),  # by rollout.name
    ("actor_rollout_ref.rollout.request_timeout_s", "request_timeout_s", 600, _as_positive_number),
)
CONFIG_KEYS = tuple(k for k, _, _, _ in _KEYS) + (STAGES_KEY,)


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
    """Read and validate the pipeline keys from a verl config; raises AsyncConfigError."""
    raw = {fld: select_value(config, key, default) for key, fld, default, _ in _KEYS}
    _check_decoupled(config, raw["decoupled_ppo"] is True)
    user_stages = parse_user_stages(select_value(config, STAGES_KEY, None))
    dynamic_sampling = dynamic_sampling_enabled(config)
    if dynamic_sampling and any(spec.name == "dynamic_sampling" for spec in user_stages):
        raise AsyncConfigError(f"{STAGES_KEY}.dynamic_sampling", "...",
                               "another name: algorithm.filter_groups.enable=True adds a stage of this name")
    values = {fld: check(key, raw[fld]) for key, fld, _, check in _KEYS if check is not None}
    values["replica_max_restarts"] = _replica_restarts("actor_rollout_ref.rollout.max_restarts",
                                                       raw["replica_max_restarts"],
                                                       select_value(config, "actor_rollout_ref.rollout.name", "vllm"))
    ratios = values["use_nodes_ratios"]
    return AsyncPipelineConfig(
        **values, user_stages=user_stages, dynamic_sampling=dynamic_sampling,
        ratios_by_role={**dict(zip(USE_NODES_ROLES, ratios)), CRITIC_ROLE: ratios[4] if len(ratios) > 4 else ratios[0]},
    )


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


def async_pipeline_enabled(config) -> bool:
    """True when the user asked for the pipeline (`+actor_rollout_ref.async_pipeline=True`)."""
    value = select_value(config, "actor_rollout_ref.async_pipeline", False)
    return value is True or (isinstance(value, str) and value.lower() == "true")
