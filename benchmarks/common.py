"""Shared parts of the benchmarks: machine description, matmul peak, statistics, result files,
launching ranks while watching their memory and output, and the fixed model and data.

Every figure a benchmark reports is a ratio against a baseline measured in the same run; absolute
numbers are printed only next to the machine description that `machine()` records.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

# Model sizes shared by the benchmarks. `small` is the reference Llama (8.4M parameters:
# hidden 256, 4 layers, vocab 8192, untied embeddings); `tiny` is for the smoke tests.
MODELS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=8192,
    ),
    "medium": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=8192,
    ),
}


def model_init(size: str, seq_len: int) -> dict[str, Any]:
    """The `model.init` block of a Llama of that size (also what the plain loops build)."""
    return {"model_type": "llama", **MODELS[size], "max_position_embeddings": seq_len, "tie_word_embeddings": False}


def build_model(init: dict[str, Any], seed: int):
    """The same fp32 Llama AstrAI builds from `model.init` (transformers, fixed seed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(init)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def parameter_count(init: dict[str, Any]) -> int:
    """Parameters of a Llama `init` block, by formula (no model built)."""
    hidden, inter, layers = init["hidden_size"], init["intermediate_size"], init["num_hidden_layers"]
    head_dim = hidden // init["num_attention_heads"]
    kv = init["num_key_value_heads"] * head_dim
    attention = hidden * hidden * 2 + hidden * kv * 2
    per_layer = attention + 3 * hidden * inter + 2 * hidden
    embeddings = init["vocab_size"] * hidden * (1 if init.get("tie_word_embeddings") else 2)
    return layers * per_layer + embeddings + hidden


# ---------------------------------------------------------------------------------------------
# Machine and peak FLOP/s


def machine() -> dict[str, Any]:
    """What the absolute numbers were measured on."""
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        memory_gib = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # a benchmark must still describe the machine without them
            versions[name] = None
    info = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": memory_gib,
        "os": f"{platform.system()} {platform.release()}",
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def matmul_peak_gflops(
    threads: int | None = None, size: int = 1024, seconds: float = 1.5, dtype: str = "float32"
) -> float:
    """Best observed GFLOP/s of a square matmul (2 n^3 FLOPs) with `threads` intra-op threads.

    Best over ~`seconds` of repeats: the machine is shared, and the peak is what the hardware can do.
    On a GPU the same function times CUDA matmuls (synchronised), so MFU is reported the same way.
    """
    import torch

    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        a = torch.randn(size, size, dtype=getattr(torch, dtype), device=device)
        b = torch.randn(size, size, dtype=getattr(torch, dtype), device=device)
        flops = 2.0 * size**3
        best = 0.0
        torch.mm(a, b)  # warm-up (thread pool, kernels)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()
            best = max(best, flops / (time.perf_counter() - started))
        return best / 1e9
    finally:
        torch.set_num_threads(previous)


def mfu(parameters: int, tokens_per_s: float, peak_gflops: float) -> float:
    """Model FLOPs utilisation: 6 x parameters x tokens/s over the measured matmul peak.

    6N per token is forward (2N) plus backward (4N); attention's extra FLOPs are not counted and the
    input-embedding lookup is (it is no matmul), as in the usual 6N rule.
    """
    return 6.0 * parameters * tokens_per_s / (peak_gflops * 1e9)


# ---------------------------------------------------------------------------------------------
# Statistics and result files


def summarize(values: list[float]) -> dict[str, Any]:
    """Median and spread of repeated measurements: spread = (max - min) / median."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None, "spread": None}
    median = statistics.median(values)
    return {
        "n": len(values),
        "median": median,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / median if median else None,
    }


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def fmt_summary(summary: dict[str, Any], digits: int = 2) -> str:
    """`median [min–max]` for a table cell."""
    if not summary or summary.get("median") is None:
        return "—"
    if summary["n"] == 1:
        return fmt(summary["median"], digits)
    return f"{fmt(summary['median'], digits)} [{fmt(summary['min'], digits)}–{fmt(summary['max'], digits)}]"


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += [
        "| " + " | ".join(fmt(cell) if not isinstance(cell, str) else cell for cell in row) + " |" for row in rows
    ]
    return "\n".join(lines)


def machine_line(info: dict[str, Any]) -> str:
    versions = info["versions"]
    gpu = f", GPU {info['gpu']}" if info.get("gpu") else ""
    return (
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB{gpu}; {info['os']}; "
        f"python {versions['python']}, torch {versions['torch']}, deepspeed {versions['deepspeed']}, "
        f"transformers {versions['transformers']}; load average at start {info['load_average_at_start']}."
    )


def add_launch_arguments(parser, name: str) -> None:
    """The options every benchmark that launches its own workers shares: where results go, under which
    name, and the two its ranks receive (the parent's JSON plan and the launcher's --local_rank)."""
    import argparse

    parser.add_argument("--results-dir", default=str(RESULTS))
    parser.add_argument("--name", default=name)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # JSON plan, set by the parent
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def fresh_workspace(results_dir: str | Path, name: str) -> tuple[Path, Path, dict[str, Any]]:
    """Every benchmark's start: (results_dir, `<results_dir>/<name>_work` emptied and created, the
    machine's description, printed)."""
    results_dir = Path(results_dir)
    work = results_dir / f"{name}_work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    info = machine()
    print(machine_line(info))
    return results_dir, work, info


def write_results(
    name: str, payload: dict[str, Any], markdown: str, results_dir: Path | None = None
) -> tuple[Path, Path]:
    """`<results>/<name>.json` (everything measured) and `<name>.md` (the table for docs/benchmarks.md)."""
    folder = Path(results_dir or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{name}.json", folder / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=1, default=str))
    md_path.write_text(markdown.rstrip() + "\n")
    print(markdown)
    print(f"\nwrote {json_path} and {md_path}")
    return json_path, md_path


def command_line() -> str:
    """How this benchmark was started, for the docs."""
    script = os.path.relpath(sys.argv[0], REPO) if os.path.isabs(sys.argv[0]) else sys.argv[0]
    return " ".join(["python", script, *sys.argv[1:]])


# ---------------------------------------------------------------------------------------------
# Launching ranks


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment of launched ranks: repo importable, no hub, no inherited thread settings."""
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)  # each variant sets what it measures
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update({key: str(value) for key, value in extra.items()})
    return env


def deepspeed_command(ranks: int, script: str | Path, *args: str) -> list[str]:
    launcher = str(Path(sys.executable).with_name("deepspeed"))
    return [launcher, f"--num_gpus={ranks}", "--master_port", str(free_port()), str(script), *args]


@dataclass
class Launch:
    """What one launch did: exit code, wall time, timestamped output lines, peak RSS per rank."""

    returncode: int
    wall_s: float
    lines: list[tuple[float, str]]  # (seconds since launch, text), stdout and stderr, split on \r and \n
    peak_rss_mib: dict[int, float] = field(default_factory=dict)  # local rank -> peak RSS (VmHWM) in MiB

    def first(self, pattern: str) -> float | None:
        """Seconds since launch of the first output fragment matching `pattern`."""
        regex = re.compile(pattern)
        return next((t for t, text in self.lines if regex.search(text)), None)

    def last(self, pattern: str) -> float | None:
        regex = re.compile(pattern)
        return next((t for t, text in reversed(self.lines) if regex.search(text)), None)

    def text(self) -> str:
        return "\n".join(text for _, text in self.lines)


def _rank_of(cmdline: list[str]) -> int | None:
    for part in cmdline:
        match = re.match(r"--local_rank=(\d+)$", part)
        if match:
            return int(match.group(1))
    return None


def _peak_rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def launch(
    command: list[str], *, env: dict[str, str], timeout: float = 900, poll_s: float = 0.2, log: Path | None = None
) -> Launch:
    """Run `command` (a launcher or one process), timestamping every output fragment and polling the
    peak RSS (VmHWM, a high-water mark kept by the kernel) of each rank process until it exits.

    A rank is a descendant whose command line has `--local_rank=N`, or, when `command` is not the
    `deepspeed` launcher, the process itself (rank 0).
    """
    import psutil

    launcher = Path(command[0]).name == "deepspeed"
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[tuple[float, str]] = []

    def reader() -> None:
        # A fragment's time is when its first byte arrived: a progress bar writes "\r<bar>", so its
        # fragment only ends with the next write, which may be another line's text.
        buffer, buffer_time = b"", 0.0
        while chunk := process.stdout.read1(65536):
            now = time.perf_counter() - started
            *complete, tail = re.split(rb"[\r\n]", buffer + chunk)
            for index, part in enumerate(complete):
                if part.strip():
                    lines.append((buffer_time if index == 0 and buffer else now, part.decode(errors="replace")))
            if tail and (complete or not buffer):
                buffer_time = now
            buffer = tail
        if buffer.strip():
            lines.append((buffer_time, buffer.decode(errors="replace")))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    peaks: dict[int, float] = {}
    root = psutil.Process(process.pid)
    deadline = started + timeout
    while process.poll() is None:
        if time.perf_counter() > deadline:
            process.kill()
            break
        try:
            members = [root] + root.children(recursive=True)
        except psutil.Error:
            members = []
        ranks = {member.pid: _rank_of(_cmdline(member)) for member in members}
        for pid, rank in ranks.items():
            if rank is None and not launcher and pid == process.pid:
                rank = 0
            if rank is None:
                continue
            peak = _peak_rss_mib(pid)
            if peak is not None:
                peaks[rank] = max(peaks.get(rank, 0.0), peak)
        time.sleep(poll_s)
    process.wait()
    wall = time.perf_counter() - started
    thread.join(timeout=5)
    result = Launch(process.returncode, wall, lines, dict(sorted(peaks.items())))
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("\n".join(f"{t:8.3f} {text}" for t, text in lines) + "\n")
    return result


def _cmdline(process) -> list[str]:
    """A process's command line, or [] once it is gone or a zombie."""
    try:
        return process.cmdline()
    except Exception:
        return []


def busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPUs busy (any process) over `seconds`, from /proc/stat: how loaded the shared
    machine was just before a launch."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
        return 1.0 - (idle1 - idle0) / max(1, total1 - total0)
    except (OSError, ValueError, IndexError):
        return float("nan")


def require_success(result: Launch, what: str) -> None:
    if result.returncode != 0:
        tail = "\n".join(text for _, text in result.lines[-40:])
        raise RuntimeError(f"{what} failed with exit code {result.returncode}:\n{tail}")


# ---------------------------------------------------------------------------------------------
# Fixed SFT data: every row renders to at least `seq_len` tokens and is truncated to exactly that,
# so every micro-batch is [micro_batch, seq_len] for AstrAI and the plain loops alike.


def prepare_sft_data(folder: Path, rows: int, seq_len: int, seed: int = 0) -> dict[str, Path]:
    """Writes `data.jsonl` (chat rows), `tokenizer/` (a char tokenizer built by AstrAI's own builder)
    and `tokens.pt` (`input_ids`, `loss_mask`: [rows, seq_len], AstrAI's own rendering) under `folder`."""
    import random

    import torch

    from astrai.data.render import chat_ids_and_mask
    from astrai.models.tokenizer import build_tokenizer, save_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    generator = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-=*/.,"
    chats = []
    for _ in range(rows):
        prompt = "".join(generator.choice(alphabet) for _ in range(seq_len // 4))
        answer = "".join(generator.choice(alphabet) for _ in range(seq_len))
        chats.append([{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}])
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    tokenizer = build_tokenizer("char", [alphabet + "\n"])
    save_tokenizer(tokenizer, folder / "tokenizer")
    ids, masks = [], []
    for chat in chats:
        row_ids, row_mask = chat_ids_and_mask(tokenizer, chat)
        assert len(row_ids) >= seq_len, "a benchmark row must fill the whole sequence"
        ids.append(row_ids[:seq_len])
        masks.append(row_mask[:seq_len])
    tokens = folder / "tokens.pt"
    torch.save({"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(masks)}, tokens)
    return {"data": data, "tokenizer": folder / "tokenizer", "tokens": tokens}
