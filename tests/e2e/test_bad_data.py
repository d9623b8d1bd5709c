"""Bad data is named by file and row: unusable rows before Ray starts, a prompt over
`data.max_prompt_length` with `data.truncation=error` at its batch."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from async_rl.core.data_checks import BadDataError, check_rl_files, prompt_too_long_error
from helpers.rows import step_rows
from helpers.runs import run_verl

LONG_ROW = 7


def demo_rows(demo_dir: Path, n: int) -> pd.DataFrame:
    return pd.read_parquet(demo_dir / "data" / "train.parquet").head(n).reset_index(drop=True)


def write(frame: pd.DataFrame, path: Path) -> str:
    frame.to_parquet(path)
    return str(path)


def test_good_files_pass(demo_dir, tmp_path):
    """Usable rows pass however they look (the demo's files; a blank system message before the user's; an
    empty ground truth, which verl reads as given; several row groups), and the files' columns come back."""
    rows = demo_rows(demo_dir, 8)
    rows.at[4, "prompt"] = [{"role": "system", "content": " "}, {"role": "user", "content": "12"}]
    rows.at[6, "reward_model"] = {"style": "rule", "ground_truth": ""}
    path = str(tmp_path / "good.parquet")
    rows.to_parquet(path, row_group_size=3)
    files = [str(demo_dir / "data" / "train.parquet"), str(demo_dir / "data" / "val.parquet"), path]
    assert check_rl_files(files) == set(rows.columns) == {"data_source", "prompt", "ability", "reward_model",
                                                          "extra_info"}


def test_missing_reward_model_column_names_the_file(demo_dir, tmp_path):
    path = write(demo_rows(demo_dir, 8).drop(columns=["reward_model"]), tmp_path / "no_rm.parquet")
    with pytest.raises(BadDataError, match=f"data.val_files: {path} has no 'reward_model' column"):
        check_rl_files(["/elsewhere/is/skipped.jsonl", path], label="data.val_files")


def test_a_row_without_ground_truth_is_named(demo_dir, tmp_path):
    rows = demo_rows(demo_dir, 8)
    rows.at[5, "reward_model"] = None
    path = write(rows, tmp_path / "rm_none.parquet")
    with pytest.raises(BadDataError, match=f"{path} row 5: 'reward_model' is None"):
        check_rl_files(path)


def test_an_empty_prompt_is_named(demo_dir, tmp_path):
    rows = demo_rows(demo_dir, 8)
    rows.at[3, "prompt"] = [{"role": "user", "content": "   "}]
    path = write(rows, tmp_path / "empty.parquet")
    with pytest.raises(BadDataError, match=f"{path} row 3: the prompt \\('prompt'\\) is empty"):
        check_rl_files(path)
    rows.at[3, "prompt"] = []
    with pytest.raises(BadDataError, match="row 3"):
        check_rl_files(write(rows, tmp_path / "no_messages.parquet"))


def test_multimodal_rows_a_run_cannot_serve_are_refused_at_start_naming_the_column(demo_dir, tmp_path):
    from omegaconf import OmegaConf

    from async_rl.file_checks import refused_media

    rows = demo_rows(demo_dir, 8)
    rows["images"] = [[b"png"]] * len(rows)
    path = write(rows, tmp_path / "with_images.parquet")
    assert "images" in check_rl_files(path)  # nothing refused: the rows pass, their columns come back
    data = {"image_key": "images", "video_key": "videos", "audio_key": None}
    on_cpu = refused_media(OmegaConf.create({"data": data, "actor_rollout_ref": {"rollout": {"name": "cpu"}}}))
    assert set(on_cpu) == {"videos"}  # the CPU backend serves images
    check_rl_files(path, refused_media=on_cpu)
    on_vllm = refused_media(OmegaConf.create({"data": data, "actor_rollout_ref": {"rollout": {"name": "vllm"}}}))
    with pytest.raises(BadDataError, match=rf"{path} has the multimodal column 'images': "
                                           r"actor_rollout_ref.rollout.name=vllm takes no images .* the backends that do: cpu"):
        check_rl_files(path, refused_media=on_vllm)
    rows["videos"] = rows["images"]
    with pytest.raises(BadDataError, match="'videos': the async pipeline runs text and image prompts only"):
        check_rl_files(write(rows, tmp_path / "with_videos.parquet"), refused_media=on_cpu)


def test_image_rows_on_cpu_need_use_remove_padding_off_naming_the_key():
    from omegaconf import OmegaConf

    from async_rl.core.errors import AsyncConfigError
    from async_rl.file_checks import check_image_rows

    def config(device, remove_padding):
        return OmegaConf.create({"data": {"image_key": "images"}, "trainer": {"device": device},
                                 "actor_rollout_ref": {"model": {"use_remove_padding": remove_padding}}})

    with pytest.raises(AsyncConfigError, match="actor_rollout_ref.model.use_remove_padding=True; allowed: False with "
                                               "image rows .* needs flash-attention"):
        check_image_rows(config("cpu", True), {"prompt", "images"})
    check_image_rows(config("cpu", False), {"prompt", "images"})
    check_image_rows(config("cpu", True), {"prompt"})  # text rows: verl's packed path is patched for CPU
    check_image_rows(config("cuda", True), {"prompt", "images"})  # flash-attention is there


def test_a_long_prompt_is_located_by_file_and_row(demo_dir, tmp_path):
    rows = demo_rows(demo_dir, 16)
    first = write(rows.head(4), tmp_path / "a.parquet")
    second = write(rows.tail(12).reset_index(drop=True), tmp_path / "b.parquet")
    error = prompt_too_long_error([first, second], "prompt", list(rows.at[9, "prompt"]), 40, 16)
    assert str(error).startswith(f"{second} row 5: the prompt is 40 tokens, over data.max_prompt_length=16")


def test_truncation_error_refuses_a_long_prompt_and_other_modes_left_truncate(demo_dir):
    from transformers import AutoTokenizer

    from async_rl.core.prompts import tokenize_row

    tokenizer = AutoTokenizer.from_pretrained(demo_dir / "model")
    files = str(demo_dir / "data" / "train.parquet")
    row = {"raw_prompt": list(demo_rows(demo_dir, 1).at[0, "prompt"]), "data_source": "d"}
    full, _ = tokenize_row(row, tokenizer, 1000, "error", files)
    kept, fields = tokenize_row({**row, "dummy_tensor": torch.zeros(1)}, tokenizer, 4, "left", files)
    assert kept == full[-4:] and fields == row  # every field the agent loop gets, tensors aside
    with pytest.raises(BadDataError, match=f"{files} row 0: the prompt is {len(full)} tokens"):
        tokenize_row(row, tokenizer, 4, "error", files)


def test_a_bad_row_fails_the_verl_command_before_ray(demo_dir, tmp_path):
    rows = demo_rows(demo_dir, 64)
    rows.at[5, "reward_model"] = {"style": "rule"}
    path = write(rows, tmp_path / "train.parquet")
    code, out, _ = run_verl(demo_dir, {"data.train_files": path}, tmp_path, timeout_s=120)
    assert code != 0
    assert f"{path} row 5: 'reward_model' is {{'style': 'rule'" in out
    assert "Started a local Ray instance" not in out


@pytest.mark.slow
def test_a_long_prompt_stops_the_run_at_its_batch_naming_file_and_row(demo_dir, tmp_path, ray_address):
    rows = demo_rows(demo_dir, 64)  # 2 batches of 32 prompts: every row is drawn within 2 steps
    rows.at[LONG_ROW, "prompt"] = [{"role": "user", "content": "1234" * 20}]
    path = write(rows, tmp_path / "train.parquet")
    extra = {"data.train_files": path, "data.truncation": "error", "trainer.total_training_steps": 2,
             "trainer.test_freq": -1, "trainer.val_before_train": False}
    code, out, rows_logged = run_verl(demo_dir, extra, tmp_path, timeout_s=300, ray_address=ray_address)
    assert code != 0
    assert "stage 'dataloader' failed" in out
    assert f"{path} row {LONG_ROW}: the prompt is" in out and "data.truncation=error" in out
    assert len(step_rows(rows_logged)) < 2  # the batch holding it never trained
