"""The pipeline's config keys (async_rl/core/config.py): one table, defaults and fail-fast validation; the
README's table is the table's."""

import pytest
from omegaconf import OmegaConf

from async_rl.core.config import (
    CONFIG_KEYS,
    KEYS,
    USE_NODES_ROLES,
    AsyncPipelineConfig,
    async_pipeline_enabled,
    read_async_config,
    readme_table,
)
from async_rl.core.errors import AsyncConfigError

RATIOS = "trainer.use_nodes_ratios"
AHEAD = "trainer.generate_ahead_steps"
ENABLED = "actor_rollout_ref.async_pipeline"
DUAL = "actor_rollout_ref.rollout.enable_dual_buffer"
PREDUCE = "actor_rollout_ref.rollout.param_update_preduce_bucket_size_mb"
CONSUME = "actor_rollout_ref.rollout.param_update_consume_bucket_size_mb"
STALL = "trainer.async_stall_timeout_s"
REWARD = "reward.async_timeout_s"
DECOUPLED = "algorithm.decoupled_ppo"
CAP = "algorithm.behav_imp_weight_cap"
PARTIAL = "actor_rollout_ref.rollout.partial_rollout"
PROXIMAL = "algorithm.proximal_logp_workers"
PROXIMAL_METHOD = "algorithm.proximal_logp_method"
STAGE_PROCESSES = "trainer.stage_processes"
REQUEST_TIMEOUT = "actor_rollout_ref.rollout.request_timeout_s"
TOOL_TIMEOUT = "actor_rollout_ref.rollout.multi_turn.tool_timeout_s"
STOP_DEADLINE = "trainer.stop_deadline_s"
TRACE_PATH = "trainer.async_trace_path"
TOOL_POOL_SIZE = "actor_rollout_ref.rollout.multi_turn.tool_pool_size"
REPLICA_RESTARTS = "actor_rollout_ref.rollout.max_restarts"
DELTA = "actor_rollout_ref.rollout.param_update_delta_sync"

BOOL_KEYS = (ENABLED, DUAL, DECOUPLED, PARTIAL, DELTA)
POSITIVE_KEYS = (PREDUCE, CONSUME, STALL, REWARD, REQUEST_TIMEOUT, TOOL_TIMEOUT, STOP_DEADLINE)


def nested(values: dict) -> dict:
    """{'a.b.c': 1} -> {'a': {'b': {'c': 1}}}."""
    out: dict = {}
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def cfg(values: dict | None = None):
    """A verl-like config (unrelated keys in the same sections) plus `values`."""
    base = {"trainer": {"total_epochs": 1, "project_name": "p"}, "actor_rollout_ref": {"rollout": {"name": "vllm"}}}
    config = OmegaConf.create(base)
    return OmegaConf.merge(config, OmegaConf.create(nested(values or {})))


def rejected(key, value) -> AsyncConfigError:
    with pytest.raises(AsyncConfigError) as info:
        read_async_config(cfg({key: value}))
    assert info.value.key == key
    return info.value


# ---- defaults -------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: OmegaConf.create({}), cfg], ids=["empty", "verl-like"])
def test_defaults_when_no_key_present(make):
    c = read_async_config(make())
    assert c.enabled is False
    assert c.use_nodes_ratios == (0.5, 0.5, 0.5, 0.5)
    assert c.enable_dual_buffer is True
    assert c.preduce_bucket_size_mb == 512.0
    assert c.consume_bucket_size_mb == 128.0
    assert c.generate_ahead_steps == 2 and c.max_staleness == 1
    assert c.stall_timeout_s == 600.0
    assert c.reward_timeout_s == 60.0
    assert c.ratios_by_role == {"train": 0.5, "logp": 0.5, "ref_logp": 0.5, "generate": 0.5, "critic": 0.5}
    assert c.decoupled_ppo is True and c.behav_imp_weight_cap == 5.0 and c.partial_rollout is True
    assert c.proximal_logp_workers == "train"
    assert c == AsyncPipelineConfig(ratios_by_role=dict(zip(USE_NODES_ROLES + ("critic",), (0.5,) * 5)))


def test_the_key_table_is_the_one_source_of_defaults_and_of_the_readme():
    from pathlib import Path

    defaults = AsyncPipelineConfig()
    for key in KEYS:
        if key.check is not None:  # read by the table: its default is the dataclass's, and it checks that default
            assert getattr(defaults, key.field) == key.default == key.check(key.key, key.default), key.key
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert readme_table() in readme, "README's configuration table differs from async_rl/core/config.py KEYS"
    assert [k.key for k in KEYS] == list(CONFIG_KEYS)


def test_config_keys_listed():
    assert set(CONFIG_KEYS) == set(BOOL_KEYS + POSITIVE_KEYS + (RATIOS, AHEAD, CAP, PROXIMAL, PROXIMAL_METHOD,
                                                                "reward.on_error",
                                                                "trainer.max_restarts", "trainer.async_stages",
                                                                REPLICA_RESTARTS, TOOL_POOL_SIZE, TRACE_PATH,
                                                                STAGE_PROCESSES))
    assert len(CONFIG_KEYS) == 24


def test_every_key_is_read():
    c = read_async_config(
        cfg(
            {
                ENABLED: True,
                RATIOS: [1, 0.25, 0.75, 1.0],
                DUAL: False,
                PREDUCE: 64,
                CONSUME: 0.5,
                AHEAD: 4,
                STALL: 30,
                STOP_DEADLINE: 12,
                REWARD: 2.5,
                DECOUPLED: False,
                CAP: 2,
                PARTIAL: False,
                PROXIMAL: "logp",
                PROXIMAL_METHOD: "loglinear",
                TOOL_TIMEOUT: 7,
                TOOL_POOL_SIZE: 3,
                STAGE_PROCESSES: "per_stage",
            }
        )
    )
    assert c.stage_processes == "per_stage" and read_async_config(cfg({})).stage_processes == "per_node"
    assert c.decoupled_ppo is False and c.partial_rollout is False and c.proximal_logp_workers == "logp"
    assert c.proximal_logp_method == "loglinear" and read_async_config(cfg({})).proximal_logp_method == "recompute"
    assert c.behav_imp_weight_cap == 2.0 and isinstance(c.behav_imp_weight_cap, float)
    assert c.enabled is True and c.enable_dual_buffer is False
    assert c.use_nodes_ratios == (1.0, 0.25, 0.75, 1.0)
    assert all(isinstance(r, float) for r in c.use_nodes_ratios)
    assert c.ratios_by_role == {"train": 1.0, "logp": 0.25, "ref_logp": 0.75, "generate": 1.0, "critic": 1.0}

    assert c.preduce_bucket_size_mb == 64.0 and isinstance(c.preduce_bucket_size_mb, float)
    assert c.consume_bucket_size_mb == 0.5
    assert c.generate_ahead_steps == 4 and c.max_staleness == 3
    assert c.stall_timeout_s == 30.0 and c.reward_timeout_s == 2.5 and c.stop_deadline_s == 12.0
    assert c.tool_timeout_s == 7.0 and isinstance(c.tool_timeout_s, float)
    assert c.tool_pool_size == 3 and read_async_config(cfg({})).tool_pool_size is None


def test_a_fifth_ratio_is_the_critics():
    c = read_async_config(cfg({RATIOS: [0.5, 0.25, 0.25, 0.5, 0.125]}))
    assert c.use_nodes_ratios == (0.5, 0.25, 0.25, 0.5, 0.125)
    assert c.ratios_by_role == {"train": 0.5, "logp": 0.25, "ref_logp": 0.25, "generate": 0.5, "critic": 0.125}


def test_ratios_as_tuple_and_interpolation_are_read():
    config = OmegaConf.create({"trainer": {"r": 0.2, "use_nodes_ratios": ["${trainer.r}", 0.3, 0.4, 0.5]}})
    assert read_async_config(config).use_nodes_ratios == (0.2, 0.3, 0.4, 0.5)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 10])
def test_max_staleness_is_k_minus_one(k):
    c = read_async_config(cfg({AHEAD: k}))
    assert c.generate_ahead_steps == k
    assert c.max_staleness == k - 1


# ---- bad values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        [0.5, 0.5, 0.5],  # too short
        [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],  # too long (a 5th is the critic's, a 6th nothing)
        [0.5, 0.5, 0.5, 0.5, 0],  # the critic's, outside (0, 1]
        [],
        0.5,  # not a list
        "0.5,0.5,0.5,0.5",
        [0.5, 0.5, 0.5, "0.5"],  # an element of the wrong type
        [0.5, True, 0.5, 0.5],  # bools are not numbers here
        [0.5, None, 0.5, 0.5],
        [0, 0.5, 0.5, 0.5],  # 0 is outside (0, 1]
        [0.5, 1.5, 0.5, 0.5],
        [0.5, 0.5, -0.5, 0.5],
        [0.5, 0.5, 0.5, 1.0000001],
    ],
)
def test_bad_ratios_rejected(value):
    err = rejected(RATIOS, value)
    msg = str(err)
    assert RATIOS in msg and repr(value) in msg
    assert "(0, 1]" in msg and "4 numbers" in msg and "or 5 with the critic's last" in msg
    for role in USE_NODES_ROLES:
        assert role in msg


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", 2.0, True, None, [2]])
def test_bad_generate_ahead_steps_rejected(value):
    msg = str(rejected(AHEAD, value))
    assert f"{AHEAD}={value!r}" in msg
    assert "integer >= 1" in msg


@pytest.mark.parametrize("key", POSITIVE_KEYS)
@pytest.mark.parametrize("value", [0, -3, -0.5, "512", True, None])
def test_bad_positive_numbers_rejected(key, value):
    msg = str(rejected(key, value))
    assert f"{key}={value!r}" in msg
    assert "> 0" in msg


@pytest.mark.parametrize("key", [k for k in BOOL_KEYS if k != ENABLED])  # the flag's spellings: below
@pytest.mark.parametrize("value", ["true", "True", "false", "1", 1, 0, None])
def test_booleans_given_as_other_types_rejected(key, value):
    msg = str(rejected(key, value))
    assert f"{key}={value!r}" in msg
    assert "true or false" in msg


@pytest.mark.parametrize("value", [1, 0.5, 0, -2, "5", True, None])
def test_bad_behaviour_weight_cap_rejected(value):
    msg = str(rejected(CAP, value))
    assert f"{CAP}={value!r}" in msg and "> 1" in msg


@pytest.mark.parametrize("value", ["Train", "actor", "", None, True, 1])
def test_bad_proximal_logp_workers_rejected(value):
    msg = str(rejected(PROXIMAL, value))
    assert f"{PROXIMAL}={value!r}" in msg and "train or logp" in msg


@pytest.mark.parametrize("value", ["per_process", "", None, 1])
def test_bad_stage_processes_rejected(value):
    msg = str(rejected(STAGE_PROCESSES, value))
    assert f"{STAGE_PROCESSES}={value!r}" in msg and "per_node or per_stage" in msg


@pytest.mark.parametrize("setting", ["rollout_is: sequence", "rollout_rs: token_k1", "bypass_mode: true"])
def test_the_users_own_rollout_correction_replaces_decoupled_ppo_and_says_so(setting, caplog):
    key, value = setting.split(": ")
    user = {f"algorithm.rollout_correction.{key}": OmegaConf.create({"v": value}).v}
    with caplog.at_level("WARNING", logger="async_rl.core.config"):
        assert read_async_config(cfg(user)).decoupled_ppo is False
    assert f"algorithm.rollout_correction.{key}" in caplog.text and "not AReaL's decoupled PPO" in caplog.text
    assert read_async_config(cfg({**user, DECOUPLED: False})).decoupled_ppo is False
    with pytest.raises(AsyncConfigError) as info:  # both asked for: one would overwrite the other
        read_async_config(cfg({**user, DECOUPLED: True}))
    assert info.value.key == DECOUPLED and f"algorithm.rollout_correction.{key}" in str(info.value)
    assert read_async_config(cfg({})).decoupled_ppo is True  # the default where the command sets none


@pytest.mark.parametrize("value", ["", "  ", 3, True, ["a"]])
def test_a_trace_path_must_be_a_directory_path(value):
    assert "a directory path" in str(rejected(TRACE_PATH, value))
    assert read_async_config(cfg({TRACE_PATH: "/tmp/trace"})).trace_path == "/tmp/trace"
    assert read_async_config(cfg({})).trace_path is None


def test_error_message_format():
    err = rejected(AHEAD, 0)
    assert str(err).startswith(f"invalid config: {AHEAD}=0; allowed: ")
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("key", BOOL_KEYS)
@pytest.mark.parametrize("value", [True, False])
def test_booleans_accepted(key, value):
    c = read_async_config(cfg({key: value}))
    field = {ENABLED: "enabled", DUAL: "enable_dual_buffer", DECOUPLED: "decoupled_ppo", PARTIAL: "partial_rollout",
             DELTA: "delta_sync"}
    assert getattr(c, field[key]) is value


def test_boundary_values_accepted():
    c = read_async_config(cfg({RATIOS: [1, 1, 1, 1e-6], AHEAD: 1, PREDUCE: 1e-3}))
    assert c.use_nodes_ratios == (1.0, 1.0, 1.0, 1e-6)
    assert c.max_staleness == 0
    assert c.preduce_bucket_size_mb == 1e-3


# ---- async_pipeline_enabled -----------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [(True, True), (False, False), ("true", True), ("True", True), ("TRUE", True), ("false", False), ("yes", True),
     (1, True), (0, False), ("off", False)],
)
def test_async_pipeline_enabled(value, expected):
    assert async_pipeline_enabled(cfg({ENABLED: value})) is expected


@pytest.mark.parametrize("value", [2, 1.0, "maybe", None, [True]])
def test_async_pipeline_enabled_refuses_other_values(value):
    with pytest.raises(AsyncConfigError, match="actor_rollout_ref.async_pipeline"):
        async_pipeline_enabled(cfg({ENABLED: value}))


def test_async_pipeline_enabled_default_off():
    assert async_pipeline_enabled(OmegaConf.create({})) is False
    assert async_pipeline_enabled(cfg()) is False


# ---- verl keys the pipeline cannot serve ------------------------------------------------


def test_critic_follows_verls_rule_and_gae_without_one_is_refused(demo_dir):
    """verl's need_critic: critic.enable when set, else adv_estimator == gae (verl's default). gae with
    critic.enable=False would find no values at step 1: refused at start naming the key."""
    from verl.trainer.ppo.utils import need_critic

    from async_rl.core.config import critic_enabled
    from async_rl.demo import demo_overrides
    from async_rl.run_config import read_run_config
    from helpers.lineage import compose_ppo

    for overrides in ([], ["algorithm.adv_estimator=grpo"], ["algorithm.adv_estimator=grpo", "critic.enable=True"],
                      ["algorithm.adv_estimator=rloo", "critic.enable=False"], ["critic.enable=True"]):
        config = compose_ppo(overrides)
        assert critic_enabled(config) == need_critic(config), overrides
    assert critic_enabled(compose_ppo([])) is True
    assert critic_enabled(compose_ppo(["algorithm.adv_estimator=grpo"])) is False
    with pytest.raises(AsyncConfigError) as info:
        critic_enabled(compose_ppo(["critic.enable=False"]))
    assert info.value.key == "critic.enable" and "gae" in str(info.value)
    with pytest.raises(AsyncConfigError, match="critic.enable=False"):  # wired into the start checks
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={"algorithm.adv_estimator": "gae",
                                                                  "critic.enable": False})))


def test_verls_checkpoint_keys_are_checked_before_ray_starts(demo_dir, tmp_path):
    """A checkpoint setting that cannot work fails in the start checks, naming the key
    (each key's rules: tests/driver/test_checkpoints.py)."""
    from async_rl.demo import demo_overrides
    from async_rl.run_config import read_run_config
    from helpers.lineage import compose_ppo

    missing = str(tmp_path / "global_step_3")
    extra = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": missing}
    with pytest.raises(AsyncConfigError, match="trainer.resume_from_path=.*no actor/ in it"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra=extra)))
    with pytest.raises(AsyncConfigError, match="trainer.default_hdfs_dir"):
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={"trainer.default_hdfs_dir": "hdfs://ckpt"})))
