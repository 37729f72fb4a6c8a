"""Engines: a trainable model in its own DeepSpeed engine (`Engine`, `make_engine`), an evaluated-only
one (`FrozenEngine`), partitioned loading, and full weights from any checkpoint folder."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from astrai.checkpoint import CheckpointError
from astrai.engine.distributed import CollectiveStalledError
from astrai.engine.ds_config import parameter_groups
from astrai.engine.safe_load import load_tensor_file, trusted_loads, weights_only_torch_load
from astrai.engine.sequence_parallel import correct_zero3_reduce_scatter, sequence_mpu
from astrai.engine.streamed_writes import OpenFile, streamed_writes

logger = logging.getLogger("astrai.engine")

DS_TAG = "state"  # DeepSpeed tag folder inside each engine's checkpoint part
PARAMETER_NAMES_KEY = "astrai_parameter_names"  # in ZeRO-0 model_states files: parameter names per optimizer group


class Engine:
    """A trainable model in its own DeepSpeed engine; the interface strategies use."""

    def __init__(self, ds_engine, ds_config: dict):
        self._engine = ds_engine
        self.ds_config = ds_config
        self._stage0_grad_norm: float | None = None
        self._plain: torch.nn.Module | None = None  # ZeRO-3 sampling copy (meta between rollouts), built on first use
        if self.zero_stage == 0:
            # Without ZeRO (fp32), DeepSpeed clips with its clip_grad_norm_ and drops the norm it returns
            # (get_global_grad_norm() stays None). Keep that norm instead of a second pass over every
            # gradient (~1.3% of a step of the benchmark's 8.4M Llama on a CPU).
            ds_engine.clip_fp32_gradients = self._clip_and_keep_norm

    def _clip_and_keep_norm(self) -> None:
        from deepspeed.runtime.utils import clip_grad_norm_

        engine = self._engine
        norm = clip_grad_norm_(
            parameters=engine.module.parameters(), max_norm=engine.gradient_clipping(), mpu=engine.mpu
        )
        self._stage0_grad_norm = float(norm)

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.module

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def device(self) -> torch.device:
        return self._engine.device

    @property
    def precision(self) -> str:
        """`bf16`, `fp16` or `fp32`: the training dtype, as recorded in checkpoint manifests."""
        if self.ds_config["bf16"]["enabled"]:
            return "bf16"
        return "fp16" if self.ds_config.get("fp16", {}).get("enabled") else "fp32"

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def step(self) -> None:
        """Call after every micro-batch; DeepSpeed updates on the accumulation boundary."""
        boundary = self._engine.is_gradient_accumulation_boundary()
        if self.zero_stage == 0 and not self._engine.gradient_clipping() > 0 and boundary:
            # No clipping, so DeepSpeed computes no norm: take it from the reduced gradients.
            gradients = [p.grad for p in self.module.parameters() if p.grad is not None]
            self._stage0_grad_norm = float(torch.nn.utils.get_total_norm(gradients)) if gradients else None
        self._engine.step()
        if boundary:
            self._engine.set_gradient_accumulation_boundary(None)  # the update is done: DeepSpeed's own count again

    def mark_micro_batch(self, last: bool) -> None:
        """Before each micro-batch's forward: whether it is the last of its optimizer step. The loops mark every
        micro-batch, so a step ends where its micro-batches end, whether it runs gradient_accumulation_steps of
        them (where the mark says what DeepSpeed's own count would) or a varying number (rl.packing's token cut);
        the `step()` or `skip_update()` of the last one hands the boundary back to DeepSpeed's count. DeepSpeed
        still divides every loss by gradient_accumulation_steps, whatever the number of micro-batches."""
        self._engine.set_gradient_accumulation_boundary(last)

    def set_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """DeepSpeed's boundary set by hand (True, False, or None for its own count): `mark_micro_batch` is what
        the loops use; this serves code that drives an engine's accumulation itself (tests, benchmarks)."""
        self._engine.set_gradient_accumulation_boundary(is_boundary)

    def skip_update(self) -> None:
        """At the accumulation boundary, instead of `step()`: discard this optimizer step. DeepSpeed's own
        step runs (so every ZeRO stage clears its gradients and partition buffers its own way, and its
        counters advance) with the torch optimizer(s) it wraps and the LR schedule silenced: weights, fp32
        master weights and Adam moments stay as they were, and the schedule does not advance, as for
        DeepSpeed's own skip of an fp16 overflow step. Counted in DeepSpeed's `skipped_steps`."""
        engine, skipped_before = self._engine, self._engine.skipped_steps
        silenced = [engine.basic_optimizer, getattr(engine.optimizer, "backup_optimizer", None), engine.lr_scheduler]
        with _silenced_steps([item for item in silenced if item is not None]):
            engine.step()
        engine.set_gradient_accumulation_boundary(None)  # as after `step()`: DeepSpeed's own count again
        if engine.skipped_steps == skipped_before:  # DeepSpeed did not find the overflow itself
            engine.skipped_steps += 1

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped since the run began (DeepSpeed's counter, kept in checkpoints): by
        `skip_update`, or by DeepSpeed itself on a non-finite gradient (fp16 loss-scale overflow)."""
        return int(self._engine.skipped_steps)

    def train(self) -> None:
        self._engine.train()

    def eval(self) -> None:
        self._engine.eval()

    @property
    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    def continue_schedule(self) -> tuple[float, float]:
        """Set the optimizer's lr to this engine's schedule at its current position (after a load, which
        restores the lr the saving run's schedule left); returns the first group's lr (before, after).
        The schedule function is always this job's: LambdaLR saves a plain function's position, not the function."""
        scheduler, before = self._engine.lr_scheduler, self.lr
        if scheduler is None:
            return before, before
        position = scheduler.last_epoch
        values = [base * schedule(position) for base, schedule in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, value in zip(scheduler.optimizer.param_groups, values):
            group["lr"] = value
        scheduler._last_lr = values  # what get_last_lr() reports, as LambdaLR.step() would set it
        return before, self.lr

    @property
    def global_steps(self) -> int:
        return int(self._engine.global_steps)

    @property
    def grad_norm(self) -> float | None:
        norm = self._engine.get_global_grad_norm()
        if norm is None and self.zero_stage == 0:
            norm = self._stage0_grad_norm
        return None if norm is None else float(norm)

    def save(self, folder: Path, *, open_file: OpenFile | None = None) -> None:
        """DeepSpeed's own files (every rank's shards) under `folder`; no `latest` file (the publisher
        decides what is published). ZeRO-0 files do not name the optimizer's parameters (ZeRO files
        do): their names per optimizer group are added, so a topology change can read them.
        `open_file(path)`: a writable file object DeepSpeed's shards are serialised into instead of
        the path itself (`streamed_writes`; the publisher's `StreamedFiles.open`)."""
        names = self._parameter_names_by_group() if self.zero_stage == 0 else None
        client_state = {PARAMETER_NAMES_KEY: names} if names else {}
        with streamed_writes(self._engine, open_file), self._only_trainable_module_state():
            self._engine.save_checkpoint(
                str(folder),
                tag=DS_TAG,
                client_state=client_state,
                save_latest=False,
                exclude_frozen_parameters=self.has_frozen_parameters,
            )

    @contextlib.contextmanager
    def _only_trainable_module_state(self):
        """With frozen parameters, the module state DeepSpeed saves keeps the trainable parameters only.
        Its `exclude_frozen_parameters` drops frozen names but not their tied aliases (a tied lm_head.weight
        would carry the whole embedding matrix into every ZeRO-0/1/2 checkpoint), nor buffers of the base."""
        if not self.has_frozen_parameters:
            yield
            return
        engine, original = self._engine, self._engine.module_state_dict
        named = self.module.named_parameters(remove_duplicate=False)
        trainable = {name for name, parameter in named if parameter.requires_grad}

        def trainable_state(*args, **kwargs):
            state = original(*args, **kwargs)
            for name in [name for name in state if name not in trainable]:
                del state[name]
            return state

        engine.module_state_dict = trainable_state  # an instance attribute: DeepSpeed's class stays as it is
        try:
            yield
        finally:
            del engine.module_state_dict

    @property
    def has_frozen_parameters(self) -> bool:
        """A LoRA model's frozen base: rebuilt from its source at every start, so neither saved nor expected
        when loading (checkpoints hold the trainable parameters and their optimizer state only)."""
        return any(not parameter.requires_grad for parameter in self.module.parameters())

    def _parameter_names_by_group(self) -> list[list[str]] | None:
        """Names of the module's parameters per optimizer group, in the optimizer's order (ZeRO-0)."""
        optimizer = self._engine.optimizer
        names = {id(parameter): name for name, parameter in self.module.named_parameters()}
        # bf16/fp16 ZeRO-0 wraps the torch optimizer (its groups hold fp32 copies); `fp16_groups` are the module's.
        groups = getattr(optimizer, "fp16_groups", None) or [
            group["params"] for group in getattr(optimizer, "param_groups", None) or []
        ]
        if not groups or not all(id(parameter) in names for group in groups for parameter in group):
            return None
        return [[names[id(parameter)] for parameter in group] for group in groups]

    def load(self, folder: Path, *, with_optimizer: bool = True) -> None:
        """DeepSpeed's own load of `folder`, every file read weights-only (`safe_load.trusted_loads`);
        the parameters' names and shapes the model-states file records are checked against this
        engine's model before DeepSpeed uses them (CheckpointShapeError naming the first that differs)."""
        tag = DS_TAG if (Path(folder) / DS_TAG).is_dir() else None  # None: a plain DeepSpeed dir with `latest`
        with trusted_loads(self._engine, inspect=self._check_recorded_shapes):
            path, _ = self._engine.load_checkpoint(
                str(folder),
                tag=tag,
                load_optimizer_states=with_optimizer,
                load_lr_scheduler_states=with_optimizer,
                load_module_strict=not self.has_frozen_parameters,
            )
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint found in {folder}")

    def _check_recorded_shapes(self, path: str, states) -> None:
        """A model-states file's parameters (ZeRO: `param_shapes`; ZeRO-0: the module's tensors) against the model's."""
        if not path.endswith("model_states.pt") or not isinstance(states, dict):
            return
        recorded = {name: tuple(shape) for group in states.get("param_shapes") or [] for name, shape in group.items()}
        if not recorded:
            buffers = set(states.get("buffer_names") or [])
            module = states.get("module") or {}
            recorded = {name: tuple(tensor.shape) for name, tensor in module.items() if name not in buffers}
        check_shapes(path, recorded, self.module)

    def load_full_state(self, source) -> None:
        """Set weights, Adam moments and step, LR schedule and step counters from full (unpartitioned)
        fp32 tensors, whatever this engine's ZeRO stage and world size: the load side of a topology change.

        `source` (a `resume.portable.PortablePart`): `.names` (trainable parameters), `.tensor(key, name)` the
        full fp32 tensor of `key` ("fp32", "exp_avg", "exp_avg_sq") shaped like the parameter, and `.info`
        (`optimizer_step`, `lr_scheduler` state, `global_steps`, `global_samples`, `skipped_steps`).
        Every rank calls it. DeepSpeed's universal loader is a ZeRO-optimizer feature (nothing loads into
        ZeRO-0), so `portable_state.fill_*` fill each layout, as that loader does for the ones it knows.
        """
        if hasattr(source, "shapes"):
            folder = getattr(source, "folder", "the portable checkpoint")
            check_shapes(folder, source.shapes(), self.module, compare_names=False)
        named = {name: parameter for name, parameter in self.module.named_parameters() if parameter.requires_grad}
        missing, unknown = sorted(set(named) - set(source.names)), sorted(set(source.names) - set(named))
        if missing or unknown:
            raise ValueError(
                f"the checkpoint's parameters differ from the model's: missing {missing[:5]}, unknown {unknown[:5]}"
            )
        from astrai.engine.portable_state import fill_flat_partitions, fill_plain, fill_wrapped, fill_zero3

        optimizer, step = self._engine.optimizer, source.info.optimizer_step
        if self.zero_stage == 3:
            fill_zero3(optimizer, named, source, step)
        elif any(hasattr(parameter, "_hp_mapping") for parameter in named.values()):  # ZeRO-1/2, bf16 optimizer
            fill_flat_partitions(optimizer, named, source, step)
        elif hasattr(optimizer, "fp16_groups"):  # ZeRO-0 in bf16/fp16: DeepSpeed's FP16_Optimizer
            fill_wrapped(optimizer, named, source, step)
        elif isinstance(
            optimizer, torch.optim.Optimizer
        ):  # ZeRO-0 in fp32: the optimizer holds the module's parameters
            fill_plain(optimizer, named, source, step)
        else:
            raise ValueError(f"cannot load a full state into a {type(optimizer).__name__} (ZeRO-{self.zero_stage})")
        info, scheduler = source.info, self._engine.lr_scheduler
        if info.lr_scheduler is not None and scheduler is not None:
            scheduler.load_state_dict(dict(info.lr_scheduler))
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = lr  # load_state_dict restores the schedule's position, not the optimizer's current lr
        self._engine.global_steps, self._engine.global_samples = info.global_steps, info.global_samples
        self._engine.skipped_steps = info.skipped_steps

    @contextlib.contextmanager
    def gathered_parameters(self):
        """Full parameters on every rank for the block (ZeRO-3 gathers once; other stages hold them already)."""
        if self.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                try:
                    yield
                finally:
                    self._settle_prefetches()
        else:
            yield

    def _settle_prefetches(self) -> None:
        """Wait for the fetches ZeRO-3's hooks started inside the block. Its forward hooks still run under
        GatheredParameters: a post-forward hook releases a small partitioned parameter and the prefetcher
        fetches it again for the next forward, so at the block's end one may be in flight, and DeepSpeed
        refuses to partition it ("Cannot partition a param in flight"). Model-sized persistence thresholds
        (engine/buckets.py) leave such parameters partitioned even in tiny models."""
        offload = getattr(getattr(self._engine, "optimizer", None), "parameter_offload", None)
        if offload is not None:
            offload.get_param_coordinator()._clean_inflight_param_registry()  # waits, then releases each

    @contextlib.contextmanager
    def generation_module(self, zero3_mode: str = "copy"):
        """The module to sample from with full weights, for the block.

        ZeRO-0/1/2: the module itself. ZeRO-3 `copy`: a plain (hook-free) module of the same class,
        allocated for the block and filled one gathered parameter at a time, so no DeepSpeed hook runs
        per token and the extra memory peaks at one full copy plus one parameter (freed afterwards).
        `gather`: the partitioned module inside one gather of every parameter (DeepSpeed's hooks still
        run at every forward, and every forward is a collective: callers pass synced_gpus). On a CPU
        `copy` samples ~5x faster (benchmarks/rollout_speed.py)."""
        if self.zero_stage != 3:
            yield self.module
        elif zero3_mode == "gather":
            with self.gathered_parameters():
                yield self.module
        else:
            plain = self._filled_plain_copy()
            try:
                yield plain
            finally:
                plain.to_empty(device="meta")  # free the copy's storage until the next rollout

    def _filled_plain_copy(self) -> torch.nn.Module:
        import deepspeed

        module = self.module
        if self._plain is None:
            with torch.device("meta"):
                self._plain = type(module)(copy.deepcopy(module.config)).to(module.dtype)
            self._plain.tie_weights()  # as the engine's module, so the copy holds one tensor per tied group
            self._plain.eval()
        plain = self._plain.to_empty(device=self.device)
        targets = dict(plain.named_parameters())
        # Every name, tied ones included (lm_head.weight and embed_tokens.weight): whether the copy
        # ties them or not, each of its parameters gets its value, and a tied one is gathered once.
        for name, parameter in module.named_parameters(remove_duplicate=False):
            if name not in targets:
                continue
            try:
                with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
                    targets.pop(name).data.copy_(parameter.data)
            except RuntimeError as error:  # torch's timeout or a peer's closed connection
                plain.to_empty(device="meta")
                raise CollectiveStalledError(
                    f"rollout weight sync: the ZeRO-3 all-gather of {name} did not complete on rank {dist.get_rank()} "
                    "within runtime.dist_timeout_s: another rank died, hung, or is still busy elsewhere "
                    f"({type(error).__name__}: {error})"
                ) from error
        if targets:
            raise RuntimeError(
                f"generation copy: parameters {sorted(targets)[:3]} have no counterpart in the engine's module"
            )
        plain_buffers = dict(plain.named_buffers())
        for name, buffer in module.named_buffers():  # not partitioned by ZeRO-3 (e.g. rotary frequencies)
            plain_buffers[name].copy_(buffer)
        return plain


class CheckpointShapeError(CheckpointError):
    """The checkpoint's parameters differ from the job's model (a job error, not damage: never fallen back from)."""


def check_shapes(source, recorded: dict[str, tuple], module: torch.nn.Module, *, compare_names: bool = True) -> None:
    """Raise CheckpointShapeError naming the first parameter whose checkpoint shape (`recorded`: name ->
    shape) differs from `module`'s (ZeRO-3's partitioned ones: their full `ds_shape`), or (`compare_names`)
    the trainable parameters the checkpoint lacks and the names the model lacks."""
    parameters = dict(module.named_parameters())
    shapes = {name: tuple(getattr(parameter, "ds_shape", parameter.shape)) for name, parameter in parameters.items()}
    trainable = {name for name, parameter in parameters.items() if parameter.requires_grad}  # what optimizers record
    every_name = {name for name, _ in module.named_parameters(remove_duplicate=False)}  # tied aliases included
    for name, shape in shapes.items():
        if name in recorded and tuple(recorded[name]) != shape:
            raise CheckpointShapeError(
                f"{source}: parameter {name} has shape {list(recorded[name])} in the checkpoint but {list(shape)} "
                "in this job's model "
                "(model.init / model.path differ from the run that saved it)"
            )
    missing, unknown = sorted(trainable - set(recorded)), sorted(set(recorded) - every_name)
    if compare_names and (missing or unknown):
        raise CheckpointShapeError(
            f"{source}: the checkpoint's parameters differ from this job's model: missing {missing[:5]}, "
            f"unknown {unknown[:5]} "
            "(model.init / model.path differ from the run that saved it)"
        )


@contextlib.contextmanager
def _silenced_steps(objects: list):
    """`step` of each object (torch optimizers, an LR scheduler) does nothing inside the block; the
    instance attribute each may hold (torch's LR scheduler wraps `optimizer.step` there) is restored."""
    missing = object()
    saved = [(item, item.__dict__.get("step", missing)) for item in objects]
    for item in objects:
        item.step = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for item, original in saved:
            if original is missing:
                del item.step
            else:
                item.step = original


def consolidated_state_dict(engine_folder: str | Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from an engine's checkpoint folder written under any ZeRO stage and any
    number of ranks, on one CPU process (DeepSpeed's own zero_to_fp32 logic; no ranks needed)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = Path(engine_folder)
    tag = DS_TAG if (folder / DS_TAG).is_dir() else None
    tag_name = tag or ((folder / "latest").read_text().strip() if (folder / "latest").is_file() else None)
    shards = folder / tag_name if tag_name else folder
    if not list(shards.glob("*optim_states.pt")) and (shards / "mp_rank_00_model_states.pt").is_file():
        # ZeRO-0 keeps the whole module in one file; there are no partitions to merge.
        states = load_tensor_file(shards / "mp_rank_00_model_states.pt", map_location="cpu")
        return {name: tensor.float() for name, tensor in states["module"].items()}
    with weights_only_torch_load():  # zero_to_fp32 calls torch.load(weights_only=False) itself
        return get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag)


def make_engine(
    model: torch.nn.Module, ds_config: dict, *, weight_decay: float, schedule: Callable[[int], float]
) -> Engine:
    """Wrap one model in its own engine, optimizer (from `ds_config`) and LR schedule."""
    import deepspeed

    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, weight_decay),
        config=ds_config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
        dist_init_required=False,
        mpu=sequence_mpu(),
    )
    correct_zero3_reduce_scatter(ds_engine)
    if ds_engine.zero_optimization_stage() == 0 and dist.get_world_size() == 1:
        # An all-reduce over one rank changes nothing and copies every gradient twice (~2% of a step
        # on a CPU, benchmarks/trainer_overhead.py `ds_z0_noreduce_w1`).
        ds_engine.enable_backward_allreduce = False
    return Engine(ds_engine, ds_config)


class FrozenEngine:
    """A model that is only ever evaluated (the DPO/RL reference): no optimizer, no gradients.
    Under ZeRO-3 its parameters are partitioned like the policy's, so memory stays per-rank."""

    def __init__(self, ds_engine, ds_config: dict):
        self._engine = ds_engine
        self.ds_config = ds_config
        self._engine.eval()

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.module

    @torch.no_grad()
    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)


def make_frozen_engine(model: torch.nn.Module, trainable_config: dict) -> FrozenEngine:
    """Wrap an inference-only model with the precision and (ZeRO-3 or not) sharding of `trainable_config`."""
    import deepspeed

    stage = 3 if trainable_config["zero_optimization"]["stage"] == 3 else 0
    config = {
        "train_micro_batch_size_per_gpu": trainable_config["train_micro_batch_size_per_gpu"],
        "gradient_accumulation_steps": trainable_config["gradient_accumulation_steps"],
        "zero_optimization": {"stage": stage},
        "bf16": trainable_config["bf16"],
        "fp16": trainable_config["fp16"],
        "steps_per_print": 10**9,
    }
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    ds_engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False, mpu=sequence_mpu())
    return FrozenEngine(ds_engine, config)


def with_batch_size(ds_config: dict) -> dict:
    """A copy of `ds_config` with the `train_batch_size` DeepSpeedConfig checks (what `initialize` derives)."""
    config = copy.deepcopy(ds_config)
    config["train_batch_size"] = (
        config["train_micro_batch_size_per_gpu"]
        * config["gradient_accumulation_steps"]
        * max(1, dist.get_world_size() if dist.is_initialized() else 1)
    )
    return config


@contextlib.contextmanager
def zero3_loading(ds_config: dict, enabled: bool):
    """While active, `from_pretrained` loads weights already partitioned across ranks (ZeRO-3)."""
    if not enabled or ds_config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    keep_alive = HfDeepSpeedConfig(with_batch_size(ds_config))  # transformers reads it through a weak reference
    try:
        yield
    finally:
        del keep_alive
