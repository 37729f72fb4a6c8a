"""The failure matrix (issue #22, items 9 and 10): every bad input below ends `astrai/train.py` with ONE
line that names the problem (file, key, row, port or folder) and an exit code, never a Python traceback,
and never silently; whatever was on disk before is still there.

Exit 2: the job is wrong, found in `train.load_and_check` before any rank starts (the output folder is
not even created). Exit 1: the run failed (data, weights, output folder, rendezvous, a non-finite loss).

Every case runs the real code path: `astrai.train.main(argv)` in this process (one rank, an in-memory
store), and a real subprocess where the process boundary is the point (a read-only or full output
folder in a mount namespace of its own; a launcher whose rendezvous port is taken). The table rows are
counted by `test_the_matrix_counts_every_case`: CASES_TOTAL cases, 0 tracebacks, 0 silent.

Issue #38 adds: what went to transformers or DeepSpeed unchecked (an attention implementation that does not
exist or is not installed, a ZeRO stage that is not a number), LoRA settings that trained silently (an empty
`target_modules`, a `modules_to_save` naming no module), an empty data file, a warmup longer than the run (a
warning: the run is valid), and `python -m astrai plot` on a damaged metrics.jsonl (file and line named).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO, child_env, deepspeed_launcher, python, run_bounded

SMALL_MODEL = (
    "model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 2, "
    "num_key_value_heads: 1, max_position_embeddings: 64"
)
JOB = """\
output_dir: {folder}/run
model:
  init: {{{model}}}
tokenizer:
  build: {{kind: char}}
data: {{path: {folder}/data.jsonl, max_seq_len: 48}}
train: {{train_type: sft, max_steps: 2, micro_batch_size: 2, lr: 1e-3, seed: 3}}
runtime: {{progress_bar: false, tensorboard: false}}
"""
# Nine levels of ten aliases each: 10**9 leaves once expanded, from a 400-byte file.
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 10)}]\n" for previous, name in zip("abcdefgh", "bcdefghi")
)


@dataclass
class Case:
    """One bad input: files written into the test folder ({folder} is replaced), `--set` overrides, the
    fragment the one error line must hold, and the exit code."""

    id: str
    overrides: list[str]
    fragment: str
    code: int
    files: dict[str, str] = field(default_factory=dict)
    job_suffix: str = ""
    skip: str = ""  # why this machine cannot show the case (a package installed that the case needs absent)


TEMPLATE = ["deepspeed.config={folder}/ds.json"]
FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None
CONFIG_CASES = [
    Case("ds_config_invalid_json", TEMPLATE, "ds.json:1: not valid JSON", 2, {"ds.json": "{stage: 2"}),
    Case("ds_config_a_list", TEMPLATE, "ds.json: a DeepSpeed config must be a JSON object", 2, {"ds.json": "[1, 2]"}),
    Case(
        "ds_config_bad_value",
        TEMPLATE,
        "zero_optimization.reduce_bucket_size: Input should be greater than 0",
        2,
        {"ds.json": '{"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}'},
    ),
    Case(
        "overrides_bad_value",
        ["deepspeed.overrides={bf16: {enabled: maybe}}"],
        "bf16.enabled: Input should be a valid boolean",
        2,
    ),
    Case(
        "ds_config_section_not_object",
        TEMPLATE,
        "zero_optimization must be an object",
        2,
        {"ds.json": '{"zero_optimization": "abc"}'},
    ),
    Case(
        "overrides_zero_stage_7",
        ["deepspeed.overrides={zero_optimization: {stage: 7}}"],
        "(deepspeed.overrides): zero_optimization.stage: Input should be 0, 1, 2 or 3 (got 7)",
        2,
    ),
    Case(
        "overrides_zero_stage_not_an_integer",
        ["deepspeed.overrides={zero_optimization: {stage: bogus}}"],
        "(deepspeed.overrides): zero_optimization.stage: Input should be 0, 1, 2 or 3 (got 'bogus')",
        2,
    ),
    Case("lr_nan", ["train.lr=.nan"], "train.lr: Input should be a finite number", 2),
    Case("lr_inf", ["train.lr=.inf"], "train.lr: Input should be a finite number", 2),
    Case("output_dir_empty", ["output_dir=''"], "output_dir: must name a folder", 2),
    Case("log_level_unknown", ["runtime.log_level=LOUD"], "runtime.log_level: unknown log level 'LOUD'", 2),
    Case("log_level_unknown_in_environment", ["runtime.environment={ASTR_LOG_LEVEL: LOUD}"], "ASTR_LOG_LEVEL", 2),
    Case("environment_name_with_space", ["runtime.environment={'MY VAR': 1}"], "'MY VAR' is not a variable name", 2),
    Case("environment_name_with_equals", ["runtime.environment={'A=B': 1}"], "'A=B' is not a variable name", 2),
    Case("yaml_alias_bomb", [], "job.yaml: aliases (*name) expand the document to more than", 2, job_suffix=BOMB),
    Case(
        "yaml_nested_too_deeply",
        [],
        "job.yaml: the YAML is nested too deeply to read",
        2,
        job_suffix="deep: " + "[" * 5000 + "]" * 5000 + "\n",
    ),
    Case("job_file_not_utf8", [], "job.yaml:9: not UTF-8 text (byte 0xe9)", 2, job_suffix="# caf\udce9\n"),
    Case("yaml_recursive_alias", [], "an anchor refers to itself", 2, job_suffix="loop: &loop {again: *loop}\n"),
    Case(
        "model_init_wrong_type",
        ["model.init.hidden_size=abc"],
        "model.init: TypeError: Field 'hidden_size' expected int",
        2,
    ),
    Case(
        "model_init_heads_do_not_divide",
        ["model.init.num_attention_heads=5"],
        "not a multiple of the number of attention heads (5)",
        2,
    ),
    Case(
        "model_init_kv_heads_do_not_divide",
        ["model.init.num_key_value_heads=3", "model.init.num_attention_heads=4"],
        "num_attention_heads (4) is not a multiple of num_key_value_heads (3)",
        2,
    ),
    Case(
        "model_path_config_wrong_type",
        ["model.init=null", "model.path={folder}/model"],
        "model/config.json: TypeError: Field 'hidden_size'",
        2,
        {"model/config.json": '{"model_type": "llama", "hidden_size": "wide", "num_attention_heads": 2}'},
    ),
    Case(
        "reward_module_syntax_error",
        ["train.train_type=grpo", "reward={function: 'broken_reward:score'}"],
        "broken_reward.py:1: invalid syntax",
        2,
        {"broken_reward.py": "def score(:\n    return 1\n"},
    ),
    Case(
        "cpu_adam_without_offload",
        ["deepspeed.optimizer=cpu_adam"],
        "cpu_adam needs deepspeed.offload_optimizer: cpu",
        2,
    ),
    Case(
        "attn_implementation_unknown",
        ["model.attn_implementation=bogus"],
        "model.attn_implementation: 'bogus' is not an attention implementation of transformers",
        2,
    ),
    Case(
        "attn_implementation_unknown_in_environment",
        ["runtime.environment={ASTR_BACKEND: bogus}"],
        "ASTR_BACKEND (runtime.environment or the shell): 'bogus' is not an attention implementation",
        2,
    ),
    Case(
        "attn_implementation_not_installed",
        ["model.attn_implementation=flash_attention_2"],
        "model.attn_implementation: 'flash_attention_2' is not installed here: its package (flash-attn) is not "
        "installed (usable here: eager, ",
        2,
        skip="flash-attn is installed here" if FLASH_ATTN_INSTALLED else "",
    ),
    Case(
        "lora_target_modules_empty",
        ["model.lora={target_modules: []}"],
        "model.lora.target_modules: an empty list adapts no module: name the modules",
        2,
    ),
    Case(
        "lora_modules_to_save_unknown",
        ["model.lora={modules_to_save: [lm_head, bogus_head]}"],
        "model.lora.modules_to_save: ['bogus_head'] match no module of LlamaForCausalLM; its modules are named [",
        2,
    ),
    Case("data_file_empty", [], "data.jsonl is empty: it holds no rows", 2, {"data.jsonl": ""}),
]


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A job folder with 20 arithmetic chats; the process environment and logging restored afterwards
    (main() exports the job's environment and sets the rank variables of its one-rank group)."""
    lines = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines()[:20]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # reward modules written there import like a user's
    saved = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(saved)
    logging.getLogger().handlers.clear()


def write_case(folder: Path, case: Case) -> str:
    for name, text in case.files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text.replace("{folder}", str(folder)))
    job = folder / "job.yaml"
    job.write_bytes((JOB.format(folder=folder, model=SMALL_MODEL) + case.job_suffix).encode("utf-8", "surrogateescape"))
    return str(job)


def run_main(config: str, overrides: list[str], capfd) -> tuple[int, str]:
    from astrai.train import main

    argv = ["--config", config]
    for assignment in overrides:
        argv += ["--set", assignment]
    code = main(argv)
    captured = capfd.readouterr()
    return code, captured.out + captured.err


def assert_one_clear_line(output: str, fragment: str, code: int) -> str:
    """The run's error is one line holding `fragment` (printed as `astrai: ...` before logging exists,
    logged as `ERROR astrai: ...` after), and no traceback anywhere."""
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("astrai:") or " ERROR astrai:" in line]
    assert len(errors) == 1, f"expected one error line, got {errors}\n{output[-3000:]}"
    assert fragment in errors[0], f"{fragment!r} not in {errors[0]!r}"
    return errors[0]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=[case.id for case in CONFIG_CASES])
def test_a_bad_job_stops_before_any_rank_with_one_line(case, folder, capfd):
    if case.skip:
        pytest.skip(case.skip)
    config = write_case(folder, case)
    code, output = run_main(config, [item.replace("{folder}", str(folder)) for item in case.overrides], capfd)
    assert code == case.code, output[-3000:]
    line = assert_one_clear_line(output, case.fragment, case.code)
    assert str(folder / "job.yaml") in line or "--set" in line, line  # names the file (or the override) at fault
    assert not (folder / "run").exists(), "a job refused before any rank starts wrote into its output folder"


# ----------------------------------------------------------------------------- runtime, one rank in this process


def nonutf8_data(folder: Path) -> None:
    lines = (folder / "data.jsonl").read_bytes().splitlines(keepends=True)
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "1"}]}\n'
    (folder / "data.jsonl").write_bytes(b"".join(lines[:5] + [bad] + lines[5:]))


def test_non_utf8_row_is_named(folder, capfd):
    nonutf8_data(folder)
    code, output = run_main(write_case(folder, Case("", [], "", 1)), [], capfd)
    assert code == 1
    assert_one_clear_line(output, f"{folder / 'data.jsonl'}: row 6 (line 6) is not valid UTF-8: byte 0xe9", 1)
    assert not list((folder / "run").glob("checkpoints/step_*"))


def test_non_utf8_row_is_skipped_and_counted(folder, capfd):
    nonutf8_data(folder)
    code, output = run_main(write_case(folder, Case("", [], "", 0)), ["data.on_bad_row=skip"], capfd)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output
    assert "skipped 1 rows that are not valid UTF-8 (data.on_bad_row: skip), the first row 6 (line 6)" in output
    assert list((folder / "run").glob("checkpoints/step_*"))


def test_truncated_safetensors_is_named(folder, capfd):
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = AutoConfig.for_model("llama", **sizes, num_key_value_heads=1, max_position_embeddings=64, vocab_size=128)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder / "model")
    weights = folder / "model" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    overrides = ["model.init=null", f"model.path={folder / 'model'}"]
    code, output = run_main(write_case(folder, Case("", [], "", 1)), overrides, capfd)
    assert code == 1
    assert_one_clear_line(output, f"model.path: {weights}: cannot read the weights", 1)


def test_output_dir_that_is_a_file(folder, capfd):
    (folder / "run").write_text("not a folder\n")
    code, output = run_main(write_case(folder, Case("", [], "", 1)), [], capfd)
    assert code == 1
    assert_one_clear_line(output, f"output_dir {folder / 'run'} is a file, not a folder (", 1)
    assert (folder / "run").read_text() == "not a folder\n"


def diverging(folder: Path, mode: str) -> tuple[str, list[str]]:
    """A run whose loss is finite at step 1 and NaN from step 2 on (a learning rate of 1e30, no clipping),
    publishing a checkpoint every step."""
    overrides = [
        "train.lr=1e30",
        "train.max_grad_norm=null",
        "train.max_steps=3",
        "checkpoint.every_steps=1",
        f"train.on_nonfinite={mode}",
        "train.lr_schedule=constant",
    ]
    return write_case(folder, Case("", [], "", 1)), overrides


def test_nonfinite_loss_stops_before_a_nan_checkpoint(folder, capfd):
    from astrai.checkpoint import find_latest, verify_checkpoint

    code, output = run_main(*diverging(folder, "stop"), capfd)
    assert code == 1, output[-3000:]
    # Step 2's loss (or, past a finite loss, its gradient norm) is the first non-finite value.
    line = assert_one_clear_line(output, "step 2: non-finite policy", 1)
    assert "nothing of step 2 was published" in line and "is still the last good one" in line
    checkpoints = folder / "run" / "checkpoints"
    newest = find_latest(checkpoints, verify=True)
    assert newest is not None and newest.name.endswith("00000001"), sorted(p.name for p in checkpoints.iterdir())
    verify_checkpoint(newest)
    assert not list(checkpoints.glob("step_*2")) and not list(checkpoints.glob("step_*3"))


def test_nonfinite_loss_skips_the_step_when_asked(folder, capfd):
    from astrai.engine import consolidated_state_dict

    code, output = run_main(*diverging(folder, "skip_step"), capfd)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output and "update skipped (train.on_nonfinite: skip_step" in output
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["skipped_steps"] for record in records] == [0, 1, 2]
    checkpoints = sorted((folder / "run" / "checkpoints").glob("step_*"))
    first, last = (consolidated_state_dict(path / "policy") for path in (checkpoints[0], checkpoints[-1]))
    assert all(value.isfinite().all() for value in last.values())
    assert all((first[name] == last[name]).all() for name in first), "a skipped step changed the weights"


def listening_sockets() -> list[str]:
    """host:port (hex, as /proc/net/tcp writes them) of every socket of this process in LISTEN state."""
    inodes = set()
    for descriptor in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{descriptor}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            columns = line.split()
            if columns[3] == "0A" and columns[9] in inodes:  # 0A: LISTEN
                found.append(columns[1])
    return found


# 127.0.0.1, ::ffff:127.0.0.1 and ::1 as /proc/net/tcp{,6} write them
LOOPBACK = ("0100007F:", "0000000000000000FFFF00000100007F:", "00000000000000000000000001000000:")


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux's /proc/net/tcp")
def test_a_single_rank_run_listens_only_on_loopback(folder):
    from astrai.engine import all_reduce_sum, setup_distributed, shutdown_distributed

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME"):
        os.environ.pop(name, None)
    dist = setup_distributed(60)
    try:
        assert all_reduce_sum(2.0, dist.device) == 2.0
        import torch
        import torch.distributed

        torch.distributed.all_reduce(torch.ones(1))  # gloo's device is up
        sockets = listening_sockets()
    finally:
        shutdown_distributed()
    assert "MASTER_PORT" not in os.environ
    assert all(address.startswith(LOOPBACK) for address in sockets), f"listening beyond the loopback: {sockets}"


def test_warmup_longer_than_the_run_is_warned_once(folder, capfd):
    """A warmup past the last step trains, never at full LR: one WARNING naming the key and both numbers (a
    warning, not a refusal: a recipe tried for a few steps with `--set train.max_steps=2` keeps its warmup)."""
    code, output = run_main(write_case(folder, Case("", [], "", 0)), ["train.warmup_steps=5"], capfd)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output
    warnings = [line for line in output.splitlines() if "train.warmup_steps" in line]
    assert len(warnings) == 1, warnings
    assert " WARNING " in warnings[0], warnings
    assert "train.warmup_steps (5) is longer than the run's 2 steps (train.max_steps: 2)" in warnings[0]
    assert "never reaches train.lr" in warnings[0]


# ----------------------------------------------------------------------------- runtime, real processes


def write_metrics(folder: Path, damage: str) -> Path:
    """metrics.jsonl of 5 steps, with a line torn by a crash at the end or a damaged line in the middle."""
    records = [json.dumps({"step": step, "loss": 1.0 / step}) + "\n" for step in range(1, 6)]
    if damage == "last":
        records.append('{"step": 6, "lo')  # the write a killed run did not finish
    else:
        records.insert(2, "garbage\n")
    (folder / "metrics.jsonl").write_text("".join(records))
    return folder / "metrics.jsonl"


def test_plot_skips_a_torn_last_line_naming_it(tmp_path):
    """A crashed run leaves its last line half written: the curves are still drawn, with one warning naming
    the file and the line (the resume's trim_metrics drops such a line too)."""
    metrics = write_metrics(tmp_path, "last")
    command = [python(), "-m", "astrai", "plot", str(tmp_path), "-o", str(tmp_path / "c.png")]
    finished = run_bounded(command, timeout=300, cwd=REPO, env=child_env())
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (tmp_path / "c.png").is_file()
    warnings = [line for line in finished.stderr.splitlines() if line.startswith("astrai plot:")]
    assert warnings == [
        f"astrai plot: WARNING: {metrics}:6: skipped the damaged last line (a run stopped writing it?): "
        "Unterminated string starting at (column 13)"
    ], finished.stderr[-3000:]


def test_plot_names_a_damaged_line_in_the_middle(tmp_path):
    """A damaged line before the last is no crash's doing: refused, naming file and line, nothing drawn."""
    metrics = write_metrics(tmp_path, "middle")
    command = [python(), "-m", "astrai", "plot", str(tmp_path), "-o", str(tmp_path / "c.png")]
    finished = run_bounded(command, timeout=300, cwd=REPO, env=child_env())
    assert finished.returncode == 1, finished.stderr[-3000:]
    assert "Traceback" not in finished.stderr
    errors = [line for line in finished.stderr.splitlines() if line.startswith("astrai plot:")]
    assert errors == [f"astrai plot: {metrics}:3: damaged metrics line: Expecting value (column 1)"], errors
    assert not (tmp_path / "c.png").exists()


def can_mount() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount(), reason="a read-only and a full file system need a mount namespace (root)")
def test_read_only_and_full_output_folders(tmp_path):
    """Two `python astrai/train.py` runs in one mount namespace: output_dir on a read-only file system,
    then on a 64 KiB one that fills up at the first checkpoint. Each exits 1 with the folder and errno."""
    lines = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines()[:20]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    for name in ("readonly", "full"):
        (tmp_path / name).mkdir()
        job = JOB.format(folder=tmp_path, model=SMALL_MODEL)
        (tmp_path / f"{name}.yaml").write_text(job.replace(f"{tmp_path}/run", f"{tmp_path}/{name}/run"))
    train = f"{python()} astrai/train.py --config"
    script = (
        f"mount -t tmpfs -o ro,size=1m tmpfs {tmp_path}/readonly && "
        f"mount -t tmpfs -o size=64k tmpfs {tmp_path}/full && "
        f"echo '::case readonly' >&2; {train} {tmp_path}/readonly.yaml; echo \"::exit $?\" >&2; "
        f"echo '::case full' >&2; {train} {tmp_path}/full.yaml; echo \"::exit $?\" >&2"
    )
    finished = run_bounded(["unshare", "-m", "sh", "-c", script], timeout=300, cwd=REPO, env=child_env())
    parts = dict(part.split("\n", 1) for part in finished.stderr.split("::case ")[1:])
    expected = {
        "readonly": f"{tmp_path}/readonly/run: EROFS: Read-only file system (output_dir: ",
        "full": "ENOSPC: No space left on device",
    }
    for name, fragment in expected.items():
        output, _, code = parts[name].rpartition("::exit ")
        assert code.strip() == "1", output[-3000:]
        line = assert_one_clear_line(output, fragment, 1)
        assert f"{tmp_path}/{name}/run" in line


def test_a_taken_rendezvous_port_is_named(tmp_path):
    """The real launcher (one rank, so one TCP store) on a port another process listens on."""
    lines = (REPO / "data/arithmetic/sft.jsonl").read_text().splitlines()[:20]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "job.yaml").write_text(JOB.format(folder=tmp_path, model=SMALL_MODEL))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        arguments = ["--num_gpus=1", "--master_port", str(port), "astrai/train.py", "--config", f"{tmp_path}/job.yaml"]
        command = deepspeed_launcher() + arguments
        finished = run_bounded(command, timeout=300, cwd=REPO, env=child_env())
    assert finished.returncode == 1, finished.stderr[-3000:]
    output = finished.stdout + finished.stderr
    errors = [line for line in output.splitlines() if " ERROR astrai:" in line]
    assert "Traceback" not in output and len(errors) == 1, output[-3000:]
    assert f"rendezvous port 127.0.0.1:{port} is already in use" in errors[0] and "--master_port" in errors[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


# ----------------------------------------------------------------------------- the count

RUNTIME_CASES = [
    "non_utf8_row",
    "non_utf8_row_skipped",
    "truncated_safetensors",
    "output_dir_a_file",
    "nonfinite_stop",
    "nonfinite_skip_step",
    "single_rank_listens_on_loopback",
    "output_dir_read_only",
    "output_dir_full",
    "rendezvous_port_taken",
    "warmup_longer_than_run_warned",
    "plot_torn_last_line_skipped",
    "plot_damaged_line_named",
]
CASES_TOTAL = len(CONFIG_CASES) + len(RUNTIME_CASES)


def test_the_matrix_counts_every_case():
    """N cases, each asserting exit code, one line, no traceback and nothing lost; ids unique."""
    ids = [case.id for case in CONFIG_CASES] + RUNTIME_CASES
    assert len(set(ids)) == len(ids) == CASES_TOTAL == 43
