"""One prepared check of AstrAI on one GPU, driven by scripts/gpu_check.sh (docs/benchmarks.md, "GPU check").

    bash scripts/gpu_check.sh            # on a GPU: bf16, nccl, Qwen2.5-0.5B's shape (configs/scale_0p5b.yaml)
    bash scripts/gpu_check.sh --cpu      # the same sequence on the CPU: fp32, gloo, a tiny shape (1-2 minutes)

Phases, in order; each is one process with its own timeout, all inside --budget-s (a phase that would
start with less than its minimum left is skipped and says so):
    peak        the best square matmul (bf16 8192^3 on a GPU, fp32 1024^3 on the CPU): MFU's denominator
    nccl        a 1-rank process group (nccl on a GPU, gloo on the CPU): all_reduce and broadcast checked
    sft_sdpa    `python astrai/train.py` sft, sdpa attention, full sequences; publishes its last step
    plain_sdpa  a plain PyTorch loop of the same model, batch and data (AdamW, autocast bf16 on a GPU)
    resume      that checkpoint resumed for 2 more steps (a new output_dir)
    export      `python -m astrai export-hf` of that checkpoint, then loaded by transformers
    grpo, online_ppo         a few rollout steps on the arithmetic prompts from a random init
    sft_flash, plain_flash   sft_sdpa and plain_sdpa with flash_attention_2, when `import flash_attn` works

tokens/s is the median over the steps after --warmup; MFU = (6 N + 12 L H S) tokens/s / peak, with N the
parameters (tied embeddings once), L layers, H hidden size, S sequence length (attention's matmuls).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO,
    child_env,
    free_port,
    launch,
    machine,
    machine_line,
    markdown_table,
    matmul_peak_gflops,
    prepare_sft_data,
    write_results,
)
from benchmarks.scale_0p5b import PUBLISHED  # noqa: E402  (the publisher's log line: MiB and seconds)

CONFIG = REPO / "configs" / "scale_0p5b.yaml"
# --cpu: configs/scale_0p5b.yaml shrunk to what two cores train in seconds (the GPU keeps the 0.5B shape).
TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 2048,
}
# Minimum seconds a phase needs to be worth starting, and its own timeout (both capped by the budget left).
# The flash_attention_2 pair comes last: an extra where flash_attn is installed, never at the others' expense.
PHASES = {
    "peak": (5, 30),
    "nccl": (10, 60),
    "sft_sdpa": (60, 240),
    "plain_sdpa": (30, 120),
    "resume": (45, 150),
    "export": (30, 120),
    "grpo": (45, 150),
    "online_ppo": (60, 180),
    "sft_flash": (60, 150),
    "plain_flash": (30, 120),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", default=os.environ.get("GPU_CHECK_CPU") == "1")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu_check"))
    parser.add_argument("--work", default=None, help="checkpoints and logs (default: a temporary folder, removed)")
    parser.add_argument("--budget-s", type=float, default=450, help="wall-clock budget of all phases")
    parser.add_argument("--steps", type=int, default=None, help="sft steps (default: 20 on a GPU, 6 on the CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="sft steps left out of tokens/s (5 GPU, 2 CPU)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sft micro-batch (default: 8 GPU, 4 CPU)")
    parser.add_argument("--rl-steps", type=int, default=3, help="grpo and online_ppo rollout steps")
    parser.add_argument(
        "--optimizer", default="auto", help="deepspeed.optimizer of the AstrAI runs (auto: fused Adam on a GPU)"
    )
    parser.add_argument(
        "--precision", choices=("bf16", "fp32"), default=None, help="default: bf16 on a GPU, fp32 on the CPU"
    )
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated subset of the phases")
    parser.add_argument("--worker", choices=("plain", "nccl"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan", default=None, help=argparse.SUPPRESS)  # a worker's JSON settings
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Workers: run in their own process, print one `RESULT {json}` line.


def nccl_worker(plan: dict) -> dict:
    """A 1-rank process group of the backend AstrAI picks on this device; checks two collectives."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(plan["port"]))
    device = torch.device(plan["device"])
    started = time.perf_counter()
    extra = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        extra["device_id"] = device  # binds the communicator to the GPU at once, as AstrAI's ranks do
    dist.init_process_group(plan["backend"], **extra)
    value = torch.full((1024,), 3.0, device=device)
    dist.all_reduce(value)
    dist.broadcast(value, src=0)
    dist.barrier()
    ok = bool(torch.all(value == 3.0))
    result = {"backend": dist.get_backend(), "all_reduce_ok": ok, "setup_s": time.perf_counter() - started}
    if device.type == "cuda":
        version = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        result["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    dist.destroy_process_group()
    return result


def plain_worker(plan: dict) -> dict:
    """The baseline: the model AstrAI builds from the same `model.init`, trained by a plain PyTorch loop
    (AdamW, grad clip 1, autocast bf16 with fp32 weights on a GPU; fp32 on the CPU) on the same tokens."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.plain_loop import loss_of

    device = torch.device(plan["device"])
    settings = dict(plan["init"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(42)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=plan["attention"])
    model.to(device).train()
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, **fused)
    data = torch.load(plan["tokens"])
    micro, times = plan["micro_batch"], []
    for step in range(plan["steps"]):
        first = (step * micro) % (data["input_ids"].shape[0] - micro + 1)
        input_ids = data["input_ids"][first : first + micro].to(device)
        loss_mask = data["loss_mask"][first : first + micro].to(device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=plan["precision"] == "bf16"):
            loss = loss_of(model, input_ids, torch.ones_like(input_ids), loss_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        print(f"plain step {step + 1} loss {loss.item():.4f} {times[-1]:.3f} s", flush=True)
    steady = times[plan["warmup"] :] or times
    tokens = micro * input_ids.shape[1]
    result = {"tokens_per_s": tokens / statistics.median(steady), "step_s": statistics.median(steady)}
    if device.type == "cuda":
        result["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def run_worker(args) -> int:
    plan = json.loads(args.plan)
    result = nccl_worker(plan) if args.worker == "nccl" else plain_worker(plan)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The check


class Check:
    def __init__(self, args, work: Path):
        self.args, self.work = args, work
        self.gpu = not args.cpu
        self.device = "cuda:0" if self.gpu else "cpu"
        self.precision = args.precision or ("bf16" if self.gpu else "fp32")
        self.steps = args.steps or (20 if self.gpu else 6)
        self.warmup = args.warmup if args.warmup is not None else (5 if self.gpu else 2)
        self.micro = args.micro_batch or (8 if self.gpu else 4)
        self.seq = 1024 if self.gpu else 128
        self.deadline = time.perf_counter() + args.budget_s
        self.rows: list[dict] = []
        self.logs: list[str] = []  # the tail of every phase's output, for gpu_check_logs.txt
        self.peak_gflops: float | None = None
        self.checkpoint: Path | None = None
        self.init = self.model_init()
        self.data = prepare_sft_data(work / "data", self.steps * self.micro + 2 * self.micro, self.seq)

    # -- shapes and commands ------------------------------------------------------------------

    def model_init(self) -> dict:
        import yaml

        init = dict(yaml.safe_load(CONFIG.read_text())["model"]["init"])
        if not self.gpu:
            init.update(TINY_MODEL)
        init["max_position_embeddings"] = max(self.seq, 64)
        return init

    def astrai_overrides(self, phase: str, **extra) -> list[str]:
        """configs/scale_0p5b.yaml with this device's precision and shape, the prepared tokenizer and data."""
        settings = {
            "output_dir": str(self.work / phase),
            "model.dtype": self.precision,
            "model.attn_implementation": "sdpa",
            "model.gradient_checkpointing": False,  # an 80 GB card holds the activations; the plain loop keeps them
            "tokenizer.build": None,
            "tokenizer.path": str(self.data["tokenizer"]),
            "data.path": str(self.data["data"]),
            "data.max_seq_len": self.seq,
            "deepspeed.config": "ds_configs/zero2.json",  # one rank: AstrAI runs it as ZeRO-0
            "deepspeed.optimizer": self.args.optimizer,
            "train.micro_batch_size": self.micro,
            "train.max_steps": self.steps,
            "train.log_every_steps": 1,
            "train.logits_chunk_size": 512 if self.gpu else 64,
            "checkpoint.every_steps": 10**6,  # only the final publish
            **{f"model.init.{key}": value for key, value in self.init.items() if key != "model_type"},
            **extra,
        }
        return [part for key, value in settings.items() for part in ("--set", f"{key}={json.dumps(value)}")]

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def launch(self, phase: str, command: list[str]):
        timeout = min(PHASES[phase][1], max(self.left(), 1))
        result = launch(command, env=child_env(), timeout=timeout, log=self.work / f"{phase}.log")
        tail = "\n".join(text for _, text in result.lines[-(60 if result.returncode else 8) :])
        self.logs.append(f"===== {phase}: exit {result.returncode}, {result.wall_s:.1f} s\n{tail}\n")
        return result

    def worker(self, phase: str, kind: str, plan: dict) -> tuple[dict, dict]:
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--plan", json.dumps(plan)]
        result = self.launch(phase, command)
        lines = [text for _, text in result.lines if text.startswith("RESULT ")]
        payload = json.loads(lines[-1][len("RESULT ") :]) if lines else {}
        return {"exit": result.returncode, "wall_s": result.wall_s, "peak_rss_mib": result.peak_rss_mib.get(0)}, payload

    def train(self, phase: str, **extra) -> tuple[dict, list[dict]]:
        command = [sys.executable, str(REPO / "astrai" / "train.py"), "--config", str(CONFIG)]
        shutil.rmtree(self.work / phase, ignore_errors=True)  # a fresh output_dir (the retry of sft_sdpa too)
        result = self.launch(phase, command + self.astrai_overrides(phase, **extra))
        row = {"exit": result.returncode, "wall_s": result.wall_s, "peak_rss_mib": result.peak_rss_mib.get(0)}
        published = [match for match in (PUBLISHED.search(text) for _, text in result.lines) if match]
        if published:
            row["publish_mib"], row["publish_s"] = float(published[-1].group(2)), float(published[-1].group(3))
        metrics_file = self.work / phase / "metrics.jsonl"
        records = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
        if phase != "sft_sdpa":  # its checkpoint feeds resume and export; the others' (7-14 GB at 0.5B) go at once
            shutil.rmtree(self.work / phase, ignore_errors=True)
        return row, [record for record in records if "step" in record]

    # -- phases -------------------------------------------------------------------------------

    def phase_peak(self) -> dict:
        size, dtype = (8192, "bfloat16") if self.gpu else (1024, "float32")
        self.peak_gflops = matmul_peak_gflops(size=size, dtype=dtype, seconds=3.0 if self.gpu else 1.5)
        if self.gpu:
            import torch

            torch.cuda.empty_cache()  # the launched phases get the whole card
        return {"exit": 0, "matmul": f"{size}^3 {dtype}", "peak_tflops": self.peak_gflops / 1e3}

    def phase_nccl(self) -> dict:
        plan = {"device": self.device, "backend": "nccl" if self.gpu else "gloo", "port": free_port()}
        row, result = self.worker("nccl", "nccl", plan)
        row.update(result)
        if not result.get("all_reduce_ok"):
            row["exit"] = row["exit"] or 1
        return row

    def flops_per_token(self) -> float:
        """6 N + 12 L H S: the matmuls of forward and backward (PaLM's appendix B), N counted on the meta device."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        settings = dict(self.init)
        config = AutoConfig.for_model(settings.pop("model_type"), **settings)
        with torch.device("meta"):
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        layers, hidden = self.init["num_hidden_layers"], self.init["hidden_size"]
        return 6.0 * parameters + 12.0 * layers * hidden * self.seq

    def with_mfu(self, row: dict) -> dict:
        if row.get("tokens_per_s") and self.peak_gflops:
            row["mfu"] = self.flops_per_token() * row["tokens_per_s"] / (self.peak_gflops * 1e9)
        return row

    def phase_sft(self, phase: str, attention: str) -> dict:
        row, records = self.train(phase, **{"model.attn_implementation": attention})
        if row["exit"] and self.args.optimizer != "torch" and phase == "sft_sdpa":
            # DeepSpeed's fused Adam (`auto` on a GPU) is built on first use (nvcc, ninja); if that fails, say so and
            # measure the rest with torch's AdamW. (`--cpu --optimizer fused` takes this path on purpose: a test.)
            row["note"] = f"deepspeed.optimizer {self.args.optimizer} failed (exit {row['exit']}): rerun with torch"
            self.args.optimizer = "torch"
            retry, records = self.train(phase, **{"model.attn_implementation": attention})
            row = {**retry, "note": row["note"]}
        speeds = [record["tokens_per_s"] for record in records if "tokens_per_s" in record]
        if speeds:
            steady = speeds[self.warmup :] or speeds
            row["tokens_per_s"] = statistics.median(steady)
            row["steps"] = len(speeds)
        steps = sorted((self.work / phase / "checkpoints").glob("step_*"), key=lambda p: int(p.name[5:]))
        if row["exit"] == 0 and steps and phase == "sft_sdpa":
            self.checkpoint = steps[-1]
        return self.with_mfu(row)

    def phase_plain(self, phase: str, attention: str) -> dict:
        plan = {
            "device": self.device,
            "precision": self.precision,
            "init": self.init,
            "attention": attention,
            "tokens": str(self.data["tokens"]),
            "steps": self.steps,
            "warmup": self.warmup,
            "micro_batch": self.micro,
        }
        row, result = self.worker(phase, "plain", plan)
        row.update(result)
        return self.with_mfu(row)

    def phase_resume(self) -> dict:
        step = int(json.loads((self.checkpoint / "trainer_state.json").read_text())["step"])
        row, records = self.train("resume", **{"checkpoint.resume": str(self.checkpoint), "train.max_steps": step + 2})
        logged = [record["step"] for record in records]
        row["resumed_from"], row["steps_logged"] = step, logged
        if row["exit"] == 0 and logged != [step + 1, step + 2]:
            row["exit"], row["note"] = 1, f"expected steps {step + 1} and {step + 2} after the resume"
        return row

    def phase_export(self) -> dict:
        destination = self.work / "hf"
        command = [sys.executable, "-m", "astrai", "export-hf", str(self.checkpoint), str(destination)]
        result = self.launch("export", command)
        row = {"exit": result.returncode, "wall_s": result.wall_s, "peak_rss_mib": result.peak_rss_mib.get(0)}
        if result.returncode == 0:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(destination)  # the exported folder loads as a plain HF model
            row["exported_parameters"] = sum(p.numel() for p in model.parameters())
            del model
        return row

    def phase_rl(self, phase: str) -> dict:
        settings = {
            "train.train_type": phase,
            "data.path": "data/arithmetic/prompts.jsonl",
            "data.max_seq_len": 64,
            "train.max_steps": self.args.rl_steps,
            "train.micro_batch_size": 8,  # rollout: 4 prompts x group 2 = 8 responses, one optimizer step
            "train.logits_chunk_size": 64,
        }
        row, records = self.train(phase, **settings)
        step_s = [record["rollout_s"] + record["train_s"] for record in records if "rollout_s" in record]
        if step_s:
            row["step_s"] = statistics.median(step_s)
            row["rollout_s"] = statistics.median(record["rollout_s"] for record in records if "rollout_s" in record)
            row["steps"] = len(step_s)
        return row

    def run(self, phases: list[str]) -> None:
        flash = self.flash_attention()
        for phase in phases:
            needs_checkpoint = phase in ("resume", "export")
            row = {"phase": phase}
            if phase.endswith("_flash") and not flash:
                row.update(exit=None, note=f"skipped: {'no GPU' if not self.gpu else 'flash_attn not installed'}")
            elif needs_checkpoint and self.checkpoint is None:
                row.update(exit=None, note="skipped: sft_sdpa left no checkpoint")
            elif self.left() < PHASES[phase][0]:
                row.update(exit=None, note=f"skipped: {self.left():.0f} s of the budget left")
            else:
                print(f"[gpu_check] {phase}: starting ({self.left():.0f} s of the budget left)", flush=True)
                try:
                    row.update(self.run_phase(phase))
                except Exception as error:  # one phase's failure is reported; the rest still run
                    row.update(exit=1, note=f"{type(error).__name__}: {error}"[:300])
            self.rows.append(row)
            print(f"[gpu_check] {phase}: {summary(row)}", flush=True)

    def run_phase(self, phase: str) -> dict:
        if phase == "peak":
            return self.phase_peak()
        if phase == "nccl":
            return self.phase_nccl()
        if phase.startswith("sft_"):
            return self.phase_sft(phase, "sdpa" if phase == "sft_sdpa" else "flash_attention_2")
        if phase.startswith("plain_"):
            return self.phase_plain(phase, "sdpa" if phase == "plain_sdpa" else "flash_attention_2")
        if phase == "resume":
            return self.phase_resume()
        if phase == "export":
            return self.phase_export()
        return self.phase_rl(phase)

    def flash_attention(self) -> bool:
        if not self.gpu:
            return False
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return False
        return True


# ---------------------------------------------------------------------------------------------
# Report


def summary(row: dict) -> str:
    if row.get("exit") is None:
        return row.get("note", "skipped")
    parts = ["ok" if row["exit"] == 0 else f"exit {row['exit']}"]
    if row.get("peak_tflops") is not None:
        parts.append(f"{row['matmul']} {row['peak_tflops']:.3g} TFLOP/s")
    if row.get("tokens_per_s") is not None:
        parts.append(f"{row['tokens_per_s']:,.0f} tokens/s")
    if row.get("step_s") is not None:
        parts.append(f"{row['step_s']:.2f} s/step")
    if row.get("mfu") is not None:
        parts.append(f"MFU {100 * row['mfu']:.1f}%")
    if row.get("publish_s") is not None:
        parts.append(f"publish {row['publish_s']:.1f} s for {row['publish_mib']:,.0f} MiB")
    if row.get("backend"):
        version = f" {row['nccl_version']}" if row.get("nccl_version") else ""
        parts.append(f"{row['backend']}{version} all_reduce {'ok' if row.get('all_reduce_ok') else 'WRONG'}")
    if row.get("gpu_peak_mib") is not None:
        parts.append(f"GPU peak {row['gpu_peak_mib']:,.0f} MiB")
    if row.get("exported_parameters"):
        parts.append(f"loads in transformers ({row['exported_parameters'] / 1e6:,.1f}M parameters)")
    if row.get("resumed_from") is not None and row.get("exit") == 0:
        parts.append(f"resumed step {row['resumed_from']}, logged {row['steps_logged']}")
    if row.get("wall_s") is not None:
        parts.append(f"{row['wall_s']:.0f} s wall")
    if row.get("note"):
        parts.append(row["note"])
    return "; ".join(parts)


def render(check: Check, info: dict) -> str:
    rows = {row["phase"]: row for row in check.rows}
    device = info.get("gpu") or f"CPU ({info['cpu']}, {info['cores']} cores)"
    lines = [
        f"Device: {device}; {check.precision}, micro-batch {check.micro} x {check.seq} tokens, "
        f"{check.init['num_hidden_layers']} layers, hidden {check.init['hidden_size']}, "
        f"vocab {check.init['vocab_size']:,}.",
        "",
    ]
    sft = [(name, rows[name]) for name in ("sft_sdpa", "plain_sdpa", "sft_flash", "plain_flash") if name in rows]
    base = {name.split("_")[1]: row.get("tokens_per_s") for name, row in sft if name.startswith("plain")}
    table = []
    for name, row in sft:
        baseline = base.get(name.split("_")[1])
        ratio = row["tokens_per_s"] / baseline if row.get("tokens_per_s") and baseline else None
        mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "-"
        speed = f"{row['tokens_per_s']:,.0f}" if row.get("tokens_per_s") else "-"
        table.append([name, speed, mfu, f"{ratio:.2f}x" if ratio else "-", summary(row)])
    lines += [markdown_table(["sft", "tokens/s", "MFU", "vs plain PyTorch", "result"], table), ""]
    others = [[row["phase"], summary(row)] for row in check.rows if row["phase"] not in dict(sft)]
    lines += [markdown_table(["phase", "result"], others)]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU sequence also on a GPU machine (children inherit it)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run `bash scripts/gpu_check.sh --cpu` for the CPU sequence")
        return 2
    phases = [phase for phase in args.phases.split(",") if phase]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        print(f"gpu_check: unknown phases {unknown}; choose from {', '.join(PHASES)}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    info = machine()
    print(machine_line(info), flush=True)
    started = time.perf_counter()
    check = Check(args, work)
    try:
        check.run(phases)
    finally:
        (out / "gpu_check_logs.txt").write_text("\n".join(check.logs))
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    info["flash_attn"] = check.flash_attention()
    payload = {"machine": info, "args": vars(args), "wall_s": time.perf_counter() - started, "rows": check.rows}
    markdown = render(check, info) + f"\n\nTotal {payload['wall_s']:.0f} s. {machine_line(info)}"
    write_results("gpu_check", payload, markdown, out)
    return 0 if all(row.get("exit") in (0, None) for row in check.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
