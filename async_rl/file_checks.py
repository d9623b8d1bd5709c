"""The files a command names and what they hold, checked before Ray starts (`check_files`, from
`read_run_config`): the model, data and reward files exist, the data's rows are usable (named by file and
row), image rows and Ulysses sizes fit the model, a reward model can be served."""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf

import async_rl.rollout.backends  # noqa: F401 - registers the built-in rollout backends
from async_rl.api.rollout import registered_backends, rollout_backend
from async_rl.core.config import critic_enabled, runs_on_cpu
from async_rl.core.data_checks import check_rl_files
from async_rl.core.errors import AsyncConfigError
from async_rl.core.reward_loop_scoring import check_reward_manager
from async_rl.rollout.cpu.reward_server import check_reward_model
from async_rl.rollout.reward_models import on_devices_of_its_own, reward_model_backend, reward_model_devices
from async_rl.rollout.verl_replicas import replica_world_size

# files a command names, checked before Ray starts (the reward's are optional; verl also loads them from
# "pkg://module", not a file, and "file://path", a file)
FILE_KEYS = ("data.train_files", "actor_rollout_ref.model.path")
# reward.reward_model.model_path: check_reward_model_path
OPTIONAL_FILE_KEYS = ("reward.custom_reward_function.path", "actor_rollout_ref.model.lora_adapter_path")


def check_files(config: DictConfig) -> None:
    """The model, data and reward files exist, the data's rows are usable (named by file and row) and
    the run has steps to train."""
    for key in FILE_KEYS + OPTIONAL_FILE_KEYS:
        value = OmegaConf.select(config, key)
        if value is None and key in OPTIONAL_FILE_KEYS or str(value).startswith("pkg://"):
            continue
        paths = list(value) if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
        for path in paths:
            path = str(path).removeprefix("file://") if path else path
            if not path or (not path.startswith(("hdfs://", "s3://")) and not os.path.exists(path)):
                raise FileNotFoundError(f"{key}={path!r}: no such file or directory")
    prompt_key = str(config.data.get("prompt_key", "prompt"))
    columns, refused = set(), refused_media(config)
    for key in ("data.train_files", "data.val_files"):
        columns |= check_rl_files(OmegaConf.select(config, key), prompt_key, key, refused)
    check_image_rows(config, columns)
    if int(config.trainer.get("total_training_steps") or 0) <= 0 and int(config.trainer.total_epochs) <= 0:
        raise ValueError("set trainer.total_training_steps or trainer.total_epochs to a positive number")
    check_reward_model_path(config)
    check_reward_manager(config)
    check_sequence_parallel(config)


def refused_media(config: DictConfig) -> dict[str, str]:
    """The data columns of verl's `data.{image,video,audio}_key` this run cannot serve -> why: videos and audio
    always, images unless the rollout backend takes them (`RolloutBackend.serves_images`)."""
    refused = {str(config.data.get(key)): "the async pipeline runs text and image prompts only (no video or audio)"
               for key in ("video_key", "audio_key") if config.data.get(key)}
    backend = rollout_backend(str(config.actor_rollout_ref.rollout.name))
    if config.data.get("image_key") and not backend.serves_images:
        refused[str(config.data.image_key)] = (
            f"actor_rollout_ref.rollout.name={backend.name} takes no images under the pipeline (untested here); "
            "the backends that do: " + ", ".join(sorted(b.name for b in registered_backends() if b.serves_images)))
    return refused


REMOVE_PADDING_KEY = "actor_rollout_ref.model.use_remove_padding"


def check_image_rows(config: DictConfig, columns: set) -> None:
    """On CPU, image rows need `use_remove_padding=False`: verl's packed path for multimodal RoPE calls
    flash-attention (`NameError: _flash_use_top_left_mask`)."""
    has_images = config.data.get("image_key") and str(config.data.image_key) in columns
    if has_images and runs_on_cpu(config) and config.actor_rollout_ref.model.get("use_remove_padding"):
        raise AsyncConfigError(REMOVE_PADDING_KEY, True, f"False with image rows ({config.data.image_key!r}) on "
                               "trainer.device=cpu: verl's packed path for multimodal RoPE needs flash-attention")


# (Ulysses size key, the model it splits): verl reads the actor's for the ref too (interpolated)
SEQUENCE_PARALLEL = (("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.model.path"),
                     ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", "actor_rollout_ref.model.path"),
                     ("critic.ulysses_sequence_parallel_size", "critic.model.path"))


def check_sequence_parallel(config: DictConfig) -> None:
    """Each Ulysses size above 1 divides its model's attention heads (verl checks it only once its workers
    are up)."""
    from transformers import AutoConfig

    for key, model_key in SEQUENCE_PARALLEL:
        size = int(OmegaConf.select(config, key, default=1) or 1)
        if size <= 1 or (key.startswith("critic") and not critic_enabled(config)):
            continue
        model = AutoConfig.from_pretrained(str(OmegaConf.select(config, model_key)),
                                           trust_remote_code=bool(config.actor_rollout_ref.model.get("trust_remote_code")))
        heads = int(model.get_text_config().num_attention_heads)
        if heads % size:
            raise AsyncConfigError(key, size, f"a divisor of the {heads} attention heads of {model_key}")


def check_reward_model_path(config: DictConfig) -> None:
    """With `reward.reward_model.enable`: its model exists, its backend can run on `trainer.device`, and
    the CPU backend, when it serves it, can."""
    rm = config.reward.reward_model
    if not rm.get("enable", False):
        return
    key, path = "reward.reward_model.model_path", rm.get("model_path")
    if not path or not os.path.exists(str(path)):
        raise FileNotFoundError(f"{key}={path!r}: no such file or directory")
    reward_model_backend(config)  # AsyncConfigError where its backend cannot run on trainer.device
    if on_devices_of_its_own(config):
        one_replica = replica_world_size(rm.rollout)
        if reward_model_devices(config) < one_replica:
            raise AsyncConfigError("reward.reward_model.n_gpus_per_node", rm.n_gpus_per_node,
                                   f"with reward.reward_model.nnodes={rm.nnodes}, at least the {one_replica} devices "
                                   "one reward-model replica spans (reward.reward_model.rollout tp x dp x pp)")
        return
    why = check_reward_model(str(path), bool(config.actor_rollout_ref.model.get("trust_remote_code", False)))
    if why is not None:
        raise AsyncConfigError(key, path, f"a model the reward model's backend serves: {why}")
