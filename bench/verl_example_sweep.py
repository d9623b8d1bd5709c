"""Benchmark: every example script of verl's `examples/` folder, through the flag's start checks and, with
`--run`, trained 2 steps on the demo under the flag.

Each script runs under bash with `python`, `python3`, `torchrun` and the download tools replaced by a recorder
(`record_commands`): nothing is downloaded or trained, and each call the script would make is kept with its
arguments as the script expands them. A call of `verl.trainer.main_ppo` is composed with Hydra as main_ppo
composes it (its `--config-path` / `--config-name`), its files swapped for the demo's (`FILE_KEYS`), and put
through the checks a run makes before Ray starts: the pipeline's (`read_run_config`) and verl's own
(`validate_config`), with the flag; and verl's alone without it, as a control. The verdict names the check and
key that stopped it. The same checks run on the call adapted to the demo: its training keys (the script's keys
less those the demo owns, `DEMO_OWNS`: data, models, rollout backend, devices, sizes, logging) over the demo's
overrides, with the flag and, as a control, flag off. With `--run`, each distinct set of training keys that passes
adapted trains 2 steps on the demo under the flag, one run at a time (bench/verl_examples.py `run_one`); with
`--run-verl`, each that verl's own checks pass adapted and the flag's stop trains 2 steps with verl's own trainer:
whether verl runs here what the flag refuses.

    git clone https://github.com/volcengine/verl && git -C verl checkout v0.9.1
    python bench/verl_example_sweep.py --examples-dir verl/examples [--run] [--run-verl] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.command import OUTSIDE, command_line, shown_path  # noqa: E402

MAIN_PPO = "verl.trainer.main_ppo"
FLAG = "+actor_rollout_ref.async_pipeline=True"
VERL_TRAINER = {"+actor_rollout_ref.async_pipeline": "false"}  # verl's own trainer: the flag set false, as typed
# the commands a script calls that the recorder stands in for: the interpreters (what the sweep reads) and
# what would download, install or query a GPU
RECORDED = ("python", "python3", "torchrun", "ray", "srun", "sbatch", "conda", "module", "pip", "pip3",
            "huggingface-cli", "hf", "modelscope", "wget", "curl", "git", "nvidia-smi", "npu-smi", "sleep")
SCRIPT_TIMEOUT_S = 30
WORKDIR = f"{OUTSIDE}/workdir"  # what results show for the sweep's temporary folder

# a key that names a file or a model -> what the demo puts there ({demo}: the prepared demo's folder, {model}: the
# stand-in model)
FILE_KEYS = {
    "data.train_files": "{demo}/data/train.parquet",
    "data.val_files": "{demo}/data/val.parquet",
    "actor_rollout_ref.model.path": "{model}",
    "actor_rollout_ref.model.tokenizer_path": "{model}",
    "critic.model.path": "{model}",
    "critic.model.tokenizer_path": "{model}",
    "reward_model.model.path": "{demo}/reward_model",
    "reward_model.model.input_tokenizer": "{model}",
    "reward.reward_model.model_path": "{demo}/reward_model",
    "custom_reward_function.path": "{demo}/reward.py",
    "custom_reward_function.name": "compute_score",
    "reward.custom_reward_function.path": "{demo}/reward.py",
    "reward.custom_reward_function.name": "compute_score",
}
# the demo's model with this many attention heads stands in for the scripts' models at the start checks (a
# sequence-parallel size must divide it); the demo runs keep the demo's model
STAND_IN_HEADS = 32
# what the demo decides in a 2-step run, whatever the script sets: its data and lengths, models, the rollout
# backend (the CPU engine), devices and their layout, batch sizes, memory and speed settings of GPU engines,
# logging and the run's length
DEMO_OWNS = (
    "data.*", "*.model.path", "*tokenizer_path", "*input_tokenizer", "*custom_reward_function.*", "reward.num_workers",
    "trainer.n_gpus_per_node", "trainer.nnodes", "trainer.device", "trainer.logger", "trainer.project_name",
    "trainer.experiment_name", "trainer.save_freq", "trainer.test_freq", "trainer.total_epochs",
    "trainer.total_training_steps", "trainer.val_before_train", "trainer.default_local_dir", "trainer.resume_mode",
    "trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep", "trainer.default_hdfs_dir", "trainer.del_local_ckpt_after_load",
    "*ppo_mini_batch_size", "*micro_batch_size*", "*max_token_len*", "*use_dynamic_bsz",
    "*tensor_model_parallel_size", "*data_parallel_size", "*expert_parallel_size", "*gpu_memory_utilization",
    "*.rollout.name", "*.rollout.mode", "*fsdp_config.*", "*.fsdp.*offload*", "*.enforce_eager", "*.free_cache_engine",
    "*.max_num_batched_tokens", "*.max_num_seqs", "*.enable_chunked_prefill", "*.load_format", "*.layered_summon",
    "*.max_model_len", "*.rollout.prompt_length", "*.rollout.response_length", "*.enable_prefix_caching",
    "*.engine_kwargs.*", "*.use_fused_kernels", "*.fused_kernel_options.*", "*.use_liger", "*.use_shm",
    "*ulysses_sequence_parallel_size", "*.use_remove_padding", "*.enable_gradient_checkpointing",
    "*.enable_activation_offload", "*entropy_from_logits_with_chunking", "*entropy_checkpointing",
    "*.agent.num_workers", "*.num_workers", "ray_kwargs.*", "transfer_queue.*", "*.use_torch_compile",
    "*.checkpoint_engine.*", "*.nnodes", "*.n_gpus_per_node", "hydra.*",
)
# the demo's values where the script sets a key the demo leaves at verl's default
DEMO_VALUES = {"reward_model.rollout.name": "cpu", "reward.reward_model.rollout.name": "cpu"}


@dataclass
class Call:
    """One `main_ppo` call a script makes: Hydra's config folder and name, and its overrides as typed."""

    config_dir: str
    config_name: str
    overrides: list[str]


@dataclass
class Verdict:
    """What a call's start checks said: `passed`, or the check that stopped it (`pipeline`, `verl`, `hydra`,
    `file`) and its message; the settings the pipeline logged as done its own way."""

    passed: bool
    check: str = ""
    message: str = ""
    replaced: list[str] = field(default_factory=list)


def write_recorder(folder: Path) -> None:
    """Put, in `folder`, a stand-in for each RECORDED command that appends its name and arguments (one JSON
    list a line) to the file named by $SWEEP_RECORD and exits 0."""
    folder.mkdir(parents=True, exist_ok=True)
    body = (f"#!{sys.executable}\nimport json, os, sys\n"
            "with open(os.environ['SWEEP_RECORD'], 'a') as f:\n"
            "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n")
    for name in RECORDED:
        path = folder / name
        path.write_text(body)
        path.chmod(0o755)


def record_commands(script: Path, root: Path, recorder: Path, home: Path) -> tuple[list[list[str]], int, str]:
    """Run `script` (a path from `root`) under bash from `root` with the recorder first on PATH; the calls it made (each its command
    name and arguments), bash's exit status (-1 past SCRIPT_TIMEOUT_S) and the last line it wrote to stderr
    that is not bash's trace (`set -x`)."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as record:
        env = {"PATH": f"{recorder}:/usr/bin:/bin", "HOME": str(home), "SWEEP_RECORD": record.name,
               "LANG": "C.UTF-8"}
        try:
            done = subprocess.run(["bash", str(script)], cwd=root, env=env, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
            code, err = done.returncode, done.stderr
        except subprocess.TimeoutExpired:
            code, err = -1, f"still running after {SCRIPT_TIMEOUT_S} s"
        calls = [json.loads(line) for line in Path(record.name).read_text().splitlines() if line.strip()]
    said = [line.strip() for line in err.splitlines() if line.strip() and not line.startswith("+")]
    return calls, code, said[-1][:200] if said else ""


def main_ppo_call(argv: list[str], verl_config_dir: Path) -> Call | None:
    """The `main_ppo` call in a recorded command (`python3 -m verl.trainer.main_ppo ...` or a path to its
    file), None for any other; a relative `--config-path` is taken from the folder above `verl_config_dir`
    (main_ppo's), an absolute one as it is."""
    for i, word in enumerate(argv):  # its own command's, or after a launcher's (`ray job submit -- python3 ...`)
        if word == MAIN_PPO and i and argv[i - 1] == "-m" or word.replace("/", ".").removesuffix(".py").endswith(MAIN_PPO):
            rest = argv[i + 1:]
            break
    else:
        return None
    config_dir, config_name, overrides = str(verl_config_dir), "ppo_trainer", []
    i = 0
    while i < len(rest):
        word = rest[i]
        for option in ("--config-path", "--config-name"):
            if word == option or word.startswith(option + "="):
                value = word.partition("=")[2] if "=" in word else rest[i + 1]
                i += 0 if "=" in word else 1
                if option == "--config-path":  # Hydra: relative to the file of main_ppo's @hydra.main
                    config_dir = str((verl_config_dir.parent / value).resolve())
                else:
                    config_name = value
                break
        else:
            if "=" in word or word.startswith("~"):
                overrides.append(word)
        i += 1
    return Call(config_dir, config_name, overrides)


def key_of(override: str) -> str:
    """The dotted key an override sets (`+`, `++` and `~` stripped)."""
    return override.lstrip("+~").partition("=")[0]


def with_demo_files(overrides: list[str], demo_dir: Path, model_dir: Path) -> list[str]:
    """`overrides` with every FILE_KEYS key pointed at the demo's file (a model at `model_dir`)."""
    out = []
    for override in overrides:
        key = key_of(override)
        if key in FILE_KEYS and not override.startswith("~"):
            prefix = override[: len(override) - len(override.lstrip("+"))]
            override = f"{prefix}{key}={FILE_KEYS[key].format(demo=demo_dir, model=model_dir)}"
        out.append(override)
    return out


@contextlib.contextmanager
def _in_folder(folder: Path):
    old = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(old)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def start_check(call: Call, root: Path, demo_dir: Path, model_dir: Path, flag: bool) -> Verdict:
    """Compose `call`'s config (with the flag or without it, the demo's files, `model_dir` for the models) from
    `root`, and run the checks verl's main_ppo makes before Ray starts: with the flag, the pipeline's
    `read_run_config`, then verl's own `validate_config` (as the plugin's wrapper does); without it, verl's
    alone."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils import config as verl_config

    from async_rl.core.errors import AsyncConfigError
    from async_rl.run_config import read_run_config

    overrides = with_demo_files(call.overrides, demo_dir, model_dir)
    if flag and FLAG not in overrides:
        overrides.append(FLAG)
    GlobalHydra.instance().clear()
    try:
        with _in_folder(root), initialize_config_dir(config_dir=call.config_dir, version_base=None):
            config = compose(config_name=call.config_name, overrides=overrides)
    except Exception as exc:  # Hydra's own errors: a key verl's config lacks, a bad value
        return Verdict(False, "hydra", first_line(exc))
    verl_check = getattr(verl_config.validate_config, "__wrapped__", verl_config.validate_config)
    lines = _Lines()
    logging.getLogger("async_rl").addHandler(lines)
    try:
        with _in_folder(root):
            if flag:
                try:
                    read_run_config(config)
                except (AsyncConfigError, ValueError) as exc:
                    return Verdict(False, "pipeline", first_line(exc))
                except FileNotFoundError as exc:
                    return Verdict(False, "file", first_line(exc))
            verl_check(config=config, use_reference_policy=need_reference_policy(config),
                       use_critic=need_critic(config))
    except Exception as exc:  # verl's own checks: what its trainer would stop at too
        return Verdict(False, "verl", first_line(exc))
    finally:
        logging.getLogger("async_rl").removeHandler(lines)
    return Verdict(True, replaced=[line for line in lines.lines if "is not used" in line])


def first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0][:300] if lines else type(exc).__name__


def demo_run_keys(call: Call) -> dict:
    """The keys of `call` a 2-step demo run keeps: each it sets but those DEMO_OWNS lists (a removal `~key`
    kept as written), with DEMO_VALUES where the script sets their key."""
    keys = {}
    for override in call.overrides:
        key = key_of(override)
        if key in DEMO_VALUES:
            keys[override.partition("=")[0]] = DEMO_VALUES[key]
        elif not any(fnmatch.fnmatchcase(key, pattern) for pattern in DEMO_OWNS):
            name, _, value = override.partition("=")
            keys[name] = value
    return keys


def adapted_call(call: Call, demo_dir: Path, flag: bool = True) -> Call:
    """`call` as a 2-step demo run makes it: its training keys (`demo_run_keys`) over the demo's overrides (its
    data, model, CPU devices and sizes, the flag, or the flag set false; the demo's critic where the call trains
    one), in the call's own config."""
    from async_rl.demo import demo_overrides
    from bench.verl_examples import with_critic, with_demo_sizes

    keys = with_demo_sizes(demo_run_keys(call))
    typed = [f"{key}={value}" for key, value in {**keys, **({} if flag else VERL_TRAINER)}.items()]  # as typed
    return Call(call.config_dir, call.config_name, demo_overrides(demo_dir, extra=typed, critic=with_critic(keys)))


def sweep(examples_dir: Path, demo_dir: Path, workdir: Path, only: tuple[str, ...] = ()) -> list[dict]:
    """One row per script (sorted by path; `only`: those matching one of these globs) and per main_ppo call it
    makes: the script, the call's index, its start checks with and without the flag, its demo run keys. A
    script without such a call gets one row: the commands it called, whether its text names main_ppo, bash's
    exit status and last error line."""
    import verl

    root = workdir / "cwd"  # the script's working folder: examples/ and verl/ (its Hydra search path)
    root.mkdir(parents=True)
    (root / "examples").symlink_to(examples_dir.resolve())
    (root / "verl").symlink_to(Path(verl.__file__).parent)
    recorder, home = workdir / "recorder", workdir / "home_dir"
    write_recorder(recorder)
    home.mkdir()
    model_dir = stand_in_model(demo_dir / "model", workdir / "stand_in_model")
    verl_config_dir = Path(verl.__file__).parent / "trainer" / "config"
    rows = []
    scripts = sorted(p for p in examples_dir.rglob("*.sh")
                     if not only or any(fnmatch.fnmatchcase(str(p.relative_to(examples_dir)), g) for g in only))
    for n, script in enumerate(scripts, 1):
        name = str(script.relative_to(examples_dir))
        calls, code, last_error = record_commands(Path("examples") / name, root, recorder, home)
        ppo_calls = [c for c in (main_ppo_call(argv, verl_config_dir) for argv in calls) if c is not None]
        if not ppo_calls:
            rows.append({"script": name, "call": 0, "main_ppo": False, "bash_exit": code, "last_error": last_error,
                         "names_main_ppo": MAIN_PPO in script.read_text(errors="replace"),
                         "calls": sorted({" ".join(argv[:3]) if argv[1:2] == ["-m"] else argv[0] for argv in calls})})
        for i, call in enumerate(ppo_calls):
            rows.append({"script": name, "call": i, "main_ppo": True, "bash_exit": code, "config": call.config_name,
                         "with_flag": asdict(start_check(call, root, demo_dir, model_dir, flag=True)),
                         "verl_alone": asdict(start_check(call, root, demo_dir, model_dir, flag=False)),
                         "adapted": asdict(start_check(adapted_call(call, demo_dir), root, demo_dir,
                                                       demo_dir / "model", flag=True)),
                         "adapted_verl": asdict(start_check(adapted_call(call, demo_dir, flag=False), root, demo_dir,
                                                            demo_dir / "model", flag=False)),
                         "run_keys": demo_run_keys(call)})
        print(f"[{n}/{len(scripts)}] {name}: " + "; ".join(row_text(r)[0] for r in rows if r["script"] == name),
              flush=True)
    return rows


def stand_in_model(model_dir: Path, out: Path) -> Path:
    """A copy of the demo's model folder at `out` whose config has STAND_IN_HEADS attention heads."""
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config.update(num_attention_heads=STAND_IN_HEADS, num_key_value_heads=STAND_IN_HEADS)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def row_text(row: dict) -> tuple[str, str]:
    """(with the flag, verl's trainer) as the table words them."""
    if not row.get("main_ppo"):
        where = "its text names main_ppo, not reached" if row["names_main_ppo"] else "no main_ppo call"
        said = f" (bash exit {row['bash_exit']}: {row['last_error']})" if row["bash_exit"] else ""
        called = f"; calls {', '.join(row['calls'])}" if row["calls"] else ""
        return f"{where}{said}{called}", ""
    return verdict_text(row["with_flag"]), verdict_text(row["verl_alone"])


def verdict_text(verdict: dict) -> str:
    """`passes`, or the check that stopped a call and its message."""
    return "passes" if verdict["passed"] else f"stopped by {verdict['check']}: {verdict['message']}"


def runs_to_make(rows: list[dict], flag: bool = True) -> dict[str, list[dict]]:
    """The distinct demo runs of the rows whose demo run passes the flag's start checks (`adapted`), or with
    `flag=False` of those it does not pass while verl's own start checks do (`adapted_verl`): their keys (JSON,
    sorted) -> the rows."""
    runs: dict[str, list[dict]] = {}
    for row in rows:
        if row.get("main_ppo") and (row["adapted"]["passed"] if flag else refused_by_the_flag_only(row)):
            runs.setdefault(json.dumps(row["run_keys"], sort_keys=True), []).append(row)
    return runs


def refused_by_the_flag_only(row: dict) -> bool:
    """Adapted to the demo, the call passes verl's start checks and not the flag's."""
    return not row["adapted"]["passed"] and row.get("adapted_verl", {}).get("passed", False)


def train_runs(runs: dict[str, list[dict]], demo_dir: Path, workdir: Path, flag: bool = True) -> None:
    """Train each distinct run 2 steps under the flag (`flag=False`: with verl's own trainer); its result goes on
    each of its rows as `run` (`verl_run`)."""
    from bench.verl_examples import run_one, with_critic, with_demo_sizes

    field, label = ("run", "flag on") if flag else ("verl_run", "verl's trainer")
    for i, (keys_json, rows) in enumerate(runs.items(), 1):
        keys = with_demo_sizes(json.loads(keys_json)) | ({} if flag else VERL_TRAINER)
        result = run_one(rows[0]["script"], keys, demo_dir, workdir / f"{field}{i}", as_typed=True)
        for row in rows:
            row[field] = result
        print(f"{label}, run {i}/{len(runs)} ({', '.join(r['script'] for r in rows)}): "
              + ("trained" if result["trained"] else f"FAILED: {result.get('error', 'steps missing')}")
              + f" in {result['seconds']:.0f} s" + (" (with the demo's critic)" if with_critic(keys) else ""),
              flush=True)


def summary(rows: list[dict]) -> list[str]:
    """Counts, then one line per verdict kind with the scripts it covers."""
    ppo = [r for r in rows if r.get("main_ppo")]
    others = [r for r in rows if not r.get("main_ppo")]
    lines = [f"{len({r['script'] for r in rows})} scripts; {len(ppo)} main_ppo calls in "
             f"{len({r['script'] for r in ppo})} of them; {len(others)} scripts call no main_ppo"]
    both = [r for r in ppo if r["with_flag"]["passed"] and r["verl_alone"]["passed"]]
    only_verl = [r for r in ppo if not r["with_flag"]["passed"] and r["verl_alone"]["passed"]]
    neither = [r for r in ppo if not r["verl_alone"]["passed"]]
    only_flag = [r for r in ppo if r["with_flag"]["passed"] and not r["verl_alone"]["passed"]]
    lines.append(f"as written: {len(both)} calls pass the start checks with the flag and without it; "
                 f"{len(only_verl)} pass verl's alone and are stopped with the flag; {len(neither)} are stopped "
                 f"without the flag too (verl's own check or config); {len(only_flag)} pass only with the flag")
    for label, stopped in (("as written, stopped with the flag only", only_verl),
                           ("as written, stopped without the flag too", neither)):
        lines.append(f"{label}, by what stopped them (calls):")
        lines += [f"  {count} {reason}" for reason, count in reasons(stopped, "with_flag" if stopped is only_verl
                                                                     else "verl_alone")]
    adapted = [r for r in ppo if r["adapted"]["passed"]]
    lines.append(f"adapted to the demo (the call's training keys; the demo's data, model, devices and sizes): "
                 f"{len(adapted)} calls pass the flag's start checks, {len(ppo) - len(adapted)} are stopped:")
    lines += [f"  {count} {reason}" for reason, count in reasons([r for r in ppo if not r["adapted"]["passed"]],
                                                                 "adapted")]
    trained = [r for r in ppo if r.get("run")]
    if trained:
        ok = [r for r in trained if r["run"]["trained"]]
        lines.append(f"demo runs under the flag: {len(ok)} of {len(trained)} calls trained 2 steps "
                     f"({len(runs_to_make(trained))} distinct runs)")
    only_flag_stops = [r for r in ppo if refused_by_the_flag_only(r)]
    lines.append(f"adapted, verl's own start checks (flag off): {sum(r.get('adapted_verl', {}).get('passed', False) for r in ppo)} "
                 f"calls pass; {len(only_flag_stops)} of them are stopped by the flag's")
    verl_ran = [r for r in only_flag_stops if r.get("verl_run")]
    if verl_ran:
        lines.append(f"verl's own trainer on those, 2 demo steps: {sum(r['verl_run']['trained'] for r in verl_ran)} of "
                     f"{len(verl_ran)} calls trained ({len(runs_to_make(verl_ran, flag=False))} distinct runs); by what "
                     "stopped the flag (calls: trained by verl's trainer / failed there):")
        trained_there: dict[str, int] = {}
        for row in verl_ran:
            reason = reason_of(row, "adapted")
            trained_there[reason] = trained_there.get(reason, 0) + row["verl_run"]["trained"]
        lines += [f"  {reason}: {trained_there[reason]} / {count - trained_there[reason]}"
                  for reason, count in reasons(verl_ran, "adapted")]
    return lines


def reasons(rows: list[dict], verdict: str) -> list[tuple[str, int]]:
    """What stopped `rows` (their `verdict`: with_flag, verl_alone or adapted), most calls first: the check and the
    key its message names (`invalid config: KEY` or Hydra's `override 'KEY'`), else its message's start."""
    counts: dict[str, int] = {}
    for row in rows:
        reason = reason_of(row, verdict)
        counts[reason] = counts.get(reason, 0) + 1
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))


def reason_of(row: dict, verdict: str) -> str:
    """The check that stopped `row` (its `verdict`) and the key its message names, else its message's start."""
    message = row[verdict]["message"]
    named = re.search(r"invalid config: ([A-Za-z_]+(?:\.[A-Za-z0-9_]+)+)|override '([^']+)'", message)
    return f"{row[verdict]['check']}: " + (next(g for g in named.groups() if g) if named else message[:90])


def table(rows: list[dict]) -> list[str]:
    """The markdown table: a row per main_ppo call (per script without one): the start checks as written, with
    the flag and verl's alone, then adapted to the demo with the flag, and its 2 demo steps."""
    out = ["| verl example | as written, with the flag | as written, verl's trainer | adapted to the demo, with the "
           "flag | 2 steps on the demo, flag on | adapted, stopped by the flag only: 2 steps with verl's trainer |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        name = r["script"] + (f" (call {r['call'] + 1})" if r["call"] else "")
        flag_text, verl_text = row_text(r)
        adapted = verdict_text(r["adapted"]) if r.get("main_ppo") else ""
        out.append(f"| `{name}` | {flag_text} | {verl_text} | {adapted} | {run_text(r.get('run'))} | "
                   f"{run_text(r.get('verl_run'))} |")
    return out


def run_text(run: dict | None) -> str:
    return "" if run is None else (f"trained in {run['seconds']:.0f} s" if run["trained"]
                                   else f"failed: {run.get('error', 'steps missing')}")


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples-dir", required=True, help="verl's examples/ folder (at v0.9.1)")
    parser.add_argument("--only", default="", help="comma-separated globs of script paths under it")
    parser.add_argument("--run", action="store_true", help="train each distinct accepted run 2 steps on the demo")
    parser.add_argument("--run-verl", action="store_true",
                        help="train with verl's own trainer (flag off) each distinct demo run that verl's start checks "
                             "pass and the flag's stop, 2 steps")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    command = command_line()
    from async_rl.demo import prepare

    examples_dir = Path(args.examples_dir)
    if not examples_dir.is_dir():
        raise SystemExit(f"--examples-dir {args.examples_dir}: no such folder")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        demo_dir = Path(tmp) / "demo"
        prepare(demo_dir, seed=0)
        rows = sweep(examples_dir, demo_dir, Path(tmp) / "sweep", tuple(filter(None, args.only.split(","))))
        if args.run:
            train_runs(runs_to_make(rows), demo_dir, Path(tmp) / "runs")
        if args.run_verl:
            train_runs(runs_to_make(rows, flag=False), demo_dir, Path(tmp) / "runs", flag=False)

    def shown(text: str) -> str:  # the run keys name files of the temporary folder: no machine's paths in results
        return text.replace(tmp, WORKDIR)

    print(f"\n{command}\n{shown_path(str(examples_dir))}: verl's examples; {time.monotonic() - start:.0f} s\n")
    print(shown("\n".join(summary(rows))) + "\n")
    print(shown("\n".join(table(rows))))
    if args.json:
        Path(args.json).write_text(shown(json.dumps({"command": command, "rows": rows}, indent=1)))
    return rows


if __name__ == "__main__":
    main()
