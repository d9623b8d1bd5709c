"""A key a command adds is read by verl or by the pipeline, or the run is refused before Ray starts naming it and
its nearest keys (async_rl/core/verl_reads.py); maps whose keys are the user's stay open; verl's example scripts'
added keys are still taken; and what verl's code reads beyond its config file is all in `OUTSIDE_YAML`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from async_rl.core.config import async_pipeline_enabled
from async_rl.core.errors import AsyncConfigError
from async_rl.core.verl_keys import leaf_keys, verl_defaults
from async_rl.core.verl_reads import OUTSIDE_YAML, reading_of, refuse_unread_keys
from async_rl.demo import demo_overrides
from async_rl.run_config import read_run_config
from helpers.lineage import compose_ppo

FLAG = "+actor_rollout_ref.async_pipeline"


@pytest.fixture(scope="module")
def demo_config(demo_dir):
    return compose_ppo(demo_overrides(demo_dir))


def added(config, **keys):
    config = config.copy()
    for key, value in keys.items():
        OmegaConf.update(config, key, value, merge=False, force_add=True)
    return config


@pytest.mark.parametrize("key,value,nearest", [
    ("trainer.generate_ahead", 3, "trainer.generate_ahead_steps"),  # the pipeline's keys, each part of a name
    ("trainer.trace_path", "/tmp/trace", "trainer.async_trace_path"),
    ("trainer.stall_timeout_s", 5, "trainer.async_stall_timeout_s"),
    ("trainer.generate_ahead_step", 3, "trainer.generate_ahead_steps"),  # one letter off
    ("trainer.total_training_step", 3, "trainer.total_training_steps"),  # verl's
    ("actor_rollout_ref.rollout.partial_rollouts", True, "actor_rollout_ref.rollout.partial_rollout"),
    ("actor_rollout_ref.rollout.agent.custom_async_server.module", "x", "custom_async_server."),  # a verl class's
    ("trainer.max_ckpt_to_keep", 2, "trainer.max_actor_ckpt_to_keep"),  # verl's sft trainer reads it, PPO does not
])
def test_an_added_key_no_one_reads_is_refused_naming_it_and_its_nearest_keys(demo_dir, key, value, nearest):
    with pytest.raises(AsyncConfigError, match="neither reads this one") as refused:
        read_run_config(compose_ppo(demo_overrides(demo_dir, extra={f"+{key}": value})))
    message = str(refused.value)
    assert f"{key}={value!r}" in message
    assert nearest in message.split("nearest: ")[1], message


@pytest.mark.parametrize("key,why", [
    ("reward_model.reward_kwargs.max_resp_len", "set reward.reward_kwargs"),  # gspo's / gmpo's scripts
    ("custom_reward_function.reward_kwargs.a", "set reward.custom_reward_function.reward_kwargs"),
    ("actor_rollout_ref.rollout.checkpoint_manager_class", "own weight sync"),
    ("reward.timeout", "`limited` reward manager"),
])
def test_a_key_only_verls_own_trainer_reads_is_refused_saying_why(demo_config, key, why):
    with pytest.raises(AsyncConfigError, match=f"{key}=.*allowed: nothing: .*{why}"):
        refuse_unread_keys(added(demo_config, **{key: 1}))


def test_keys_under_maps_that_are_the_users_stay_open(demo_config):
    """Typed `dict` / `Any` in verl's classes, empty in its file, or passed on whole (ray.init's arguments);
    keys verl's classes have that its file leaves out; keys read through `.get` (OUTSIDE_YAML)."""
    config = added(demo_config, **{
        "actor_rollout_ref.model.override_config.rope_theta": 1,  # HFModelConfig.override_config: dict
        "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space": 1,
        "actor_rollout_ref.rollout.custom.anything": 1,  # RolloutConfig.custom: Optional[dict]
        "actor_rollout_ref.actor.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap": "x",
        "actor_rollout_ref.actor.optim.override_optimizer_config.foreach": False,
        "critic.model.override_config.rope_scaling.factor": 2,
        "algorithm.pf_ppo.anything": 1,  # AlgoConfig.pf_ppo: dict
        "data.apply_chat_template_kwargs.enable_thinking": False,  # {} in verl's file
        "ray_kwargs.ray_init.runtime_env.env_vars.X": 1, "ray_kwargs.ray_init.address": "auto",
        "reward.reward_kwargs.max_resp_len": 4,  # read by the reward stage (dapo's overlong buffer)
        "reward.custom_reward_function.reward_kwargs.scale": 2,
        "data.cache_dir": "/tmp/c",  # RLHFDataset's .get
        "trainer.wandb_proxy": "http://proxy",  # verl's Tracking
        "trainer.async_stages.my_stage.kwargs.k": 1,  # the pipeline's
    })
    refuse_unread_keys(config)
    assert reading_of("actor_rollout_ref.rollout.custom.anything").reader.startswith("the user's")
    assert reading_of("trainer.generate_ahead_steps").reader.startswith("the async pipeline")


# the `+` keys of verl's example scripts (at its commit b178a3cd5) that run main_ppo on FSDP, each still taken
VERL_EXAMPLES_ADDED_KEYS = {
    "grpo_trainer/run_glm41v_9b.sh (and 8 other VL / NPU scripts)": (
        "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache",),
    "grpo_trainer/run_gptoss_20b.sh": ("actor_rollout_ref.actor.fsdp_config.model_dtype",
                                       "data.apply_chat_template_kwargs.reasoning_effort"),
    "grpo_trainer/run_qwen2-32b_sglang_fsdp_npu.sh": ("actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend",),
    "grpo_trainer/run_qwen2-7b_math_trtllm.sh": (
        "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_max_tokens_ratio",
        "actor_rollout_ref.rollout.engine_kwargs.trtllm.batch_wait_timeout_iters"),
    "grpo_trainer/run_qwen3-32b_npu.sh": tuple(f"actor_rollout_ref.actor.fsdp_config.mixed_precision.{k}"
                                               for k in ("buffer_dtype", "param_dtype", "reduce_dtype")),
    "gmpo_trainer/test_dapo_7b_math.sh": ("actor_rollout_ref.model.override_config.max_position_embeddings",),
    "grpo_trainer/run_qwen3-8b_npu.sh": ("actor_rollout_ref.actor.entropy_from_logits_with_chunking",
                                         "actor_rollout_ref.ref.entropy_from_logits_with_chunking"),
    "sglang_multiturn/run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh": (
        "actor_rollout_ref.model.enable_activation_offload", "actor_rollout_ref.actor.fsdp_config.model_dtype"),
    "gspo_trainer/run_qwen3_32b_gspo_npu.sh": ("data.gen_batch_size",),
    "ppo_trainer (critic scripts)": ("critic.model.override_config.attn_implementation",
                                     "critic.optim.override_optimizer_config.optimizer_cpu_offload"),
}


@pytest.mark.parametrize("script", VERL_EXAMPLES_ADDED_KEYS)
def test_verls_example_scripts_added_keys_are_taken(demo_config, script):
    keys = VERL_EXAMPLES_ADDED_KEYS[script]
    for key in keys:
        assert reading_of(key).reader is not None, key
    refuse_unread_keys(added(demo_config, **{key: "x" for key in keys}))


def test_verls_composed_config_and_the_demo_pass(demo_config):
    refuse_unread_keys(compose_ppo([]))  # every key main_ppo composes (its `model_engine` too)
    refuse_unread_keys(demo_config)


# ---- the flag ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("typed,enabled", [
    ("True", True), ("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True), ("on", True),
    ("ON", True), ("False", False), ("false", False), ("0", False), ("no", False), ("NO", False), ("off", False),
    ("Off", False),
])
def test_the_flag_as_hydra_users_type_it(typed, enabled):
    config = compose_ppo([f"{FLAG}={typed}"])  # Hydra reads `1` as an int, `yes` / `on` as strings
    assert async_pipeline_enabled(config) is enabled


@pytest.mark.parametrize("typed", ["2", "maybe", "1.0", "null", "''", "[true]", "truee"])
def test_any_other_flag_value_is_refused_naming_it(typed):
    config = compose_ppo([f"{FLAG}={typed}"])
    with pytest.raises(AsyncConfigError, match=r"actor_rollout_ref.async_pipeline=.*allowed: true or false \(also 1"):
        async_pipeline_enabled(config)


def test_the_flag_absent_is_off():
    assert async_pipeline_enabled(compose_ppo([])) is False


# ---- what verl's code reads beyond its config file -----------------------------------------------------------

import verl  # noqa: E402

VERL_ROOT = Path(verl.__file__).parent
# modules that read one section through a local name (`config` is `data` in RLHFDataset)
SECTION_OF_LOCAL = {"utils/dataset/rl_dataset.py": {"config": "data"}}
# read only by verl's other entry points (its SFT trainer), never on main_ppo's path: an added one is refused
OTHER_ENTRY_POINTS = {"trainer.max_ckpt_to_keep", "trainer.resume_from_path"}


def _chain(node) -> list[str] | None:
    """`self.config.trainer` -> ["self", "config", "trainer"] (items `config["trainer"]` too)."""
    parts = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
        elif isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
            parts.append(node.slice.value)
        else:
            return None
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _section(chain: list[str], locals_: dict) -> str | None:
    """The config section a receiver names: the part after `config` / `self.config` that is a section of verl's
    file (`config.actor_rollout_ref.rollout` -> that path), or a module's known local."""
    if len(chain) == 1 or chain[:2] == ["self", "config"] and len(chain) == 2:
        return locals_.get(chain[-1])
    start = 2 if chain[0] == "self" else 1
    if "config" not in chain[start - 1] and "cfg" not in chain[start - 1]:
        return None
    node = verl_defaults()
    for part in chain[start:]:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return ".".join(chain[start:]) if isinstance(node, dict) and node else None


def verl_get_reads() -> dict[str, set[str]]:
    """key -> verl's modules that read it with `.get("name")`, `"name" in`, `getattr(..., "name")` on a section."""
    found: dict[str, set[str]] = {}
    for path in VERL_ROOT.rglob("*.py"):
        rel = str(path.relative_to(VERL_ROOT))
        locals_ = SECTION_OF_LOCAL.get(rel, {})
        for node in ast.walk(ast.parse(path.read_text())):
            receiver = name = None
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                receiver, name = node.func.value, node.args[0].value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                receiver, name = node.args[0], node.args[1].value
            elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
                  and isinstance(node.left, ast.Constant)):
                receiver, name = node.comparators[0], node.left.value
            if not isinstance(name, str) or receiver is None:
                continue
            chain = _chain(receiver)
            section = _section(chain, locals_) if chain else None
            if section:
                found.setdefault(f"{section}.{name}", set()).add(rel)
    return found


def decided(key: str) -> bool:
    """verl_reads knows who reads `key`, or why no one does with the flag."""
    reading = reading_of(key)
    return reading.reader is not None or bool(reading.why)


def test_every_key_verls_code_reads_is_in_its_file_its_classes_or_outside_yaml():
    """A verl upgrade that reads a new key with `.get` fails here until the key has a row in OUTSIDE_YAML (or
    is a field of a class verl builds)."""
    listed = set(leaf_keys(verl_defaults()))
    reads = verl_get_reads()
    assert len(reads) > 50  # the scan sees verl's reads (76 in verl 0.9.1), not a handful
    unknown = {key: sorted(modules) for key, modules in reads.items()
               if key not in listed and key not in OTHER_ENTRY_POINTS and not decided(key)}
    assert unknown == {}
    for key in OTHER_ENTRY_POINTS:
        assert all("sft" in module for module in reads[key]), reads[key]


@pytest.mark.parametrize("row", OUTSIDE_YAML, ids=lambda row: row.key)
def test_each_key_outside_verls_file_is_read_where_its_row_says(row):
    """A row whose key verl no longer reads (or reads elsewhere) fails here."""
    source = (VERL_ROOT / (row.reader.removeprefix("verl.").replace(".", "/") + ".py")).read_text()
    name = row.key.rsplit(".", 1)[1]
    assert f'"{name}"' in source, (row.key, row.reader)
    assert row.key not in set(leaf_keys(verl_defaults()))  # verl's file would list it: the row is not needed
