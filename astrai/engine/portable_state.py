"""DeepSpeed's side of the portable form (astrai/resume/portable.py: full fp32 state, no topology).

`read_deepspeed_state` reads one engine's DeepSpeed checkpoint (any ZeRO stage, any number of
ranks) as full tensors; `fill_*` set full tensors into a live engine's layout (called by
`Engine.load_full_state`). They live in engine/ because only engine/ knows DeepSpeed.

Why not DeepSpeed's universal checkpoint as is: `ds_to_universal` needs ZeRO optimizer shards, so
it cannot read ZeRO-0 checkpoints, and loading a universal checkpoint is a ZeRO-optimizer feature,
so nothing loads into ZeRO-0 (what one rank runs by default). So `ds_to_universal` does the hard
part of reading ZeRO-1/2/3 shards (merging partitions, padding, alignment), ZeRO-0 files are read
directly (they hold whole tensors), and each layout is filled here from full tensors: every pair
of stages goes through the same two steps.

Memory: one state of one engine (4 bytes per parameter) at a time while writing (a ZeRO-0 file is
read whole: 12-16 bytes per parameter); one parameter at a time on each rank while loading.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import logging
import shutil
from pathlib import Path

import torch

from astrai.checkpoint import CheckpointError
from astrai.engine.engines import PARAMETER_NAMES_KEY
from astrai.engine.safe_load import load_tensor_file, weights_only_torch_load
from astrai.errors import AstraiError

logger = logging.getLogger("astrai.portable")

STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")


class PortableError(AstraiError, ValueError):
    """A DeepSpeed folder that cannot be read into the portable form, or a bad portable part."""


def shard_folder(engine_folder: Path, tag: str) -> Path:
    """The folder of DeepSpeed's shard files: `<part>/<tag>/`, or the tag named by a plain DeepSpeed `latest` file."""
    folder = Path(engine_folder)
    if (folder / tag).is_dir():
        return folder / tag
    if (folder / "latest").is_file():
        return folder / (folder / "latest").read_text().strip()
    raise PortableError(f"{folder}: no DeepSpeed checkpoint (neither a {tag!r} folder nor a 'latest' file)")


def _load(path: Path):
    return load_tensor_file(path, map_location="cpu")  # weights-only: a shard is data, never code


def _model_states(shards: Path) -> dict:
    files = sorted(shards.glob("*mp_rank_00_model_states.pt"))  # ZeRO-3 writes one per rank; any has the counters
    if not files:
        raise PortableError(f"{shards}: no DeepSpeed model_states file")
    return _load(files[0])


def _recorded_stage(states: dict) -> int:
    return int((states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0))


def _counters(states: dict) -> dict:
    steps = int(states.get("global_steps", 0))
    return {
        "lr_scheduler": states.get("lr_scheduler"),
        "global_steps": steps,
        "global_samples": int(states.get("global_samples", 0)),
        "skipped_steps": int(states.get("skipped_steps", 0)),
    }


class _ZeroSource:
    """A ZeRO-1/2/3 (or bf16-optimizer) checkpoint, merged by DeepSpeed's ds_to_universal into
    `scratch`: zero/<name>/<key>.pt, a full tensor (ZeRO-3: flat, maybe padded) or {"param": tensor}."""

    def __init__(self, shards: Path, scratch: Path):
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        states = _model_states(shards)
        self.shapes = {
            name: tuple(shape) for group in states.get("param_shapes") or [] for name, shape in group.items()
        }
        if not self.shapes:
            raise PortableError(f"{shards}: the model_states file lists no parameter shapes")
        self.names = list(self.shapes)
        self.counters = _counters(states)
        self.stage = _recorded_stage(states)
        self.step = _zero_optimizer_step(sorted(shards.glob("*optim_states.pt"))[0], self.counters)
        universal = scratch / "universal"  # ds_to_universal also writes `latest_universal` next to it, in scratch
        captured = io.StringIO()
        arguments = argparse.Namespace(
            input_folder=str(shards),
            output_folder=str(universal),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        try:  # it prints progress to stdout and tqdm bars to stderr; it calls torch.load(weights_only=False) itself
            with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured), weights_only_torch_load():
                ds_to_universal(arguments)
        except CheckpointError:  # a shard refused (it names code) or unreadable: its own message names the file
            raise
        except Exception as error:
            raise PortableError(
                f"{shards}: DeepSpeed's ds_to_universal failed ({type(error).__name__}: {error}); "
                f"output:\n{captured.getvalue()[-2000:]}"
            ) from error
        self.zero = universal / "zero"

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        found = {}
        for name, shape in self.shapes.items():
            value = _load(self.zero / name / f"{key}.pt")
            value = value["param"] if isinstance(value, dict) else value
            numel = torch.Size(shape).numel()
            if value.numel() < numel:
                raise PortableError(f"{self.zero / name}/{key}.pt has {value.numel()} elements, the parameter {numel}")
            found[name] = value.flatten()[:numel].reshape(shape).float().contiguous()  # ZeRO-3 merges padded partitions
        return found


def _zero_optimizer_step(optim_file: Path, counters: dict) -> int:
    """Adam's step count from rank 0's optimizer shard (ZeRO-1/2: base_optimizer_state; ZeRO-3:
    optimizer_state_dict); every group and rank holds the same. Falls back to applied updates."""
    states = _load(optim_file)["optimizer_state_dict"]
    inner = states.get("base_optimizer_state") or states.get("optimizer_state_dict") or {}
    groups = inner.get("state") or {}
    first = next(iter(groups.values() if isinstance(groups, dict) else groups), {})
    step = first.get("step", (inner.get("param_groups") or [{}])[0].get("step"))
    return int(step) if step is not None else counters["global_steps"] - counters["skipped_steps"]


class _StageZeroSource:
    """A ZeRO-0 checkpoint: the whole module and the optimizer state in one file. In fp32 the torch
    optimizer's state is keyed by the module's parameters; in bf16/fp16 DeepSpeed's FP16_Optimizer
    wraps it and keeps fp32 masters, one per parameter (`fp32_groups`, unfused) or one flat tensor
    per group (`fp32_groups_flat`, fused Adam), the optimizer state keyed by those."""

    def __init__(self, shards: Path):
        states = _load(shards / "mp_rank_00_model_states.pt")
        self.module, optimizer = states["module"], states.get("optimizer") or {}
        self.inner = optimizer.get("optimizer_state_dict", optimizer)
        self.masters, self.flats = optimizer.get("fp32_groups"), optimizer.get("fp32_groups_flat")
        if "state" not in self.inner or "param_groups" not in self.inner:
            raise PortableError(f"{shards}: a ZeRO-0 checkpoint without an optimizer state this AstrAI reads")
        groups = states.get(PARAMETER_NAMES_KEY) or _guess_groups(self.module, set(states.get("buffer_names") or []))
        entries = [len(group["params"]) for group in self.inner["param_groups"]]
        expected = [1 if self.flats is not None else len(names) for names in groups]
        if entries != expected:
            raise PortableError(
                f"{shards}: cannot tell which parameter each optimizer entry belongs to (groups of {entries} entries, "
                f"{[len(names) for names in groups]} parameters found); resume once on the old topology to re-save it"
            )
        self.where = {}  # name -> (group, position in the group, offset in the group's flat tensor)
        for group, names in enumerate(groups):
            offsets = itertools.accumulate((self.module[name].numel() for name in names), initial=0)
            for position, (name, offset) in enumerate(zip(names, offsets)):
                self.where[name] = (group, position, offset)
        self.names = [name for names in groups for name in names]
        steps = {int(entry["step"]) for entry in self.inner["state"].values() if "step" in entry}
        self.step = max(steps, default=0)
        if len(steps) > 1:
            logger.warning(
                "%s: parameters have different Adam step counts %s; the portable form keeps %d",
                shards,
                sorted(steps),
                self.step,
            )
        self.counters = _counters(states)
        self.stage = _recorded_stage(states)

    def _value(self, key: str, name: str) -> torch.Tensor:
        group, position, offset = self.where[name]
        shape = self.module[name].shape
        if key == "fp32" and self.flats is None:
            return (
                (self.masters[group][position] if self.masters is not None else self.module[name])
                .float()
                .reshape(shape)
                .clone()
            )
        entry = self.inner["param_groups"][group]["params"][0 if self.flats is not None else position]
        value = self.flats[group] if key == "fp32" else self.inner["state"].get(entry, {}).get(key)
        if value is None:  # a parameter the optimizer never stepped
            return torch.zeros(shape)
        if self.flats is not None:
            value = value.flatten().narrow(0, offset, shape.numel())
        return value.float().reshape(shape).clone()

    def tensors(self, key: str) -> dict[str, torch.Tensor]:
        return {name: self._value(key, name).contiguous() for name in self.names}


def _guess_groups(module: dict[str, torch.Tensor], buffer_names: set[str]) -> list[list[str]]:
    """Optimizer groups of a ZeRO-0 checkpoint saved before parameter names were recorded: the
    order of `engine.parameter_groups` (matrices, then 1-D tensors, each in module order), with a
    tied weight (sharing storage with an earlier tensor, e.g. lm_head = embeddings) counted once."""
    seen, decay, no_decay = set(), [], []
    for name, tensor in module.items():
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if name in buffer_names or identity in seen:
            continue
        seen.add(identity)
        (decay if tensor.ndim >= 2 else no_decay).append(name)
    return [group for group in (decay, no_decay) if group]  # DeepSpeed drops empty groups


@contextlib.contextmanager
def read_deepspeed_state(engine_folder: Path, scratch: Path, tag: str):
    """One engine's DeepSpeed checkpoint (any ZeRO stage, any number of ranks) opened as full tensors:
    yields a source with `names`, `step`, `stage`, `counters` and `tensors(key)` for each of STATE_KEYS.
    `scratch` is a work folder, removed on leaving (the ZeRO-1/2/3 tensors are read from it)."""
    shards = shard_folder(engine_folder, tag)
    zero = any(shards.glob("*optim_states.pt"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        yield _ZeroSource(shards, scratch) if zero else _StageZeroSource(shards)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# Loading into a live engine: DeepSpeed's own layouts, filled from full tensors (see Engine.load_full_state).


def _step_value(optimizer, step: int):
    """Adam's step as the optimizer keeps it: torch's a float tensor, DeepSpeed's own Adams an int."""
    return torch.tensor(float(step)) if type(optimizer).__module__.startswith("torch.optim") else int(step)


@torch.no_grad()
def fill_plain(optimizer, named: dict, source, step: int) -> None:
    """ZeRO-0: parameters are the module's, the optimizer state is keyed by them."""
    for name, parameter in named.items():
        parameter.copy_(source.tensor("fp32", name).to(parameter.device, parameter.dtype))
        moments = {key: source.tensor(key, name).to(parameter.device).clone() for key in MOMENT_KEYS}
        optimizer.state[parameter] = {"step": _step_value(optimizer, step), **moments}


@torch.no_grad()
def fill_wrapped(optimizer, named: dict, source, step: int) -> None:
    """ZeRO-0 in bf16/fp16: the module's low-precision parameters (`fp16_groups`) beside fp32 masters,
    one per parameter (`fp32_groups`) or one flat tensor per group (`fp32_groups_flat`, unpadded)."""
    base, names = optimizer.optimizer, {id(parameter): name for name, parameter in named.items()}
    flats = getattr(optimizer, "fp32_groups_flat", None)
    for index, group in enumerate(optimizer.fp16_groups):
        full = {key: [source.tensor(key, names[id(parameter)]) for parameter in group] for key in STATE_KEYS}
        for parameter, weights in zip(group, full["fp32"]):
            parameter.copy_(weights.to(parameter.device, parameter.dtype))
        if flats is not None:
            flat = flats[index]
            values = {key: torch.cat([tensor.flatten() for tensor in full[key]]).to(flat.device) for key in STATE_KEYS}
            flat.copy_(values["fp32"])
            base.state[flat] = {"step": _step_value(base, step), **{key: values[key] for key in MOMENT_KEYS}}
            continue
        for position, master in enumerate(optimizer.fp32_groups[index]):
            master.copy_(full["fp32"][position].to(master.device))
            moments = {key: full[key][position].to(master.device).clone() for key in MOMENT_KEYS}
            base.state[master] = {"step": _step_value(base, step), **moments}


@torch.no_grad()
def fill_flat_partitions(optimizer, named: dict, source, step: int) -> None:
    """ZeRO-1/2 (and the bf16 optimizer): every rank holds the whole low-precision parameter; the
    fp32 master and the moments are one flat partition per group, of which `_hp_mapping` says which
    slice [lp.start, +numel) of the flattened parameter lies at [hp.start, +numel) on this rank."""
    base = optimizer.optimizer
    flats = [group["params"][0] for group in base.param_groups]
    moments = {key: [torch.zeros_like(flat) for flat in flats] for key in MOMENT_KEYS}
    for name, parameter in named.items():
        full = source.tensor("fp32", name)
        parameter.copy_(full.to(parameter.device, parameter.dtype))
        mapping = parameter._hp_mapping
        if mapping is None:  # no slice of it in this rank's partition
            continue
        lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
        mapping.hp_fragment.copy_(full.flatten().narrow(0, lp.start, lp.numel))
        for key in MOMENT_KEYS:
            piece = source.tensor(key, name).flatten().narrow(0, lp.start, lp.numel)
            moments[key][mapping.param_group_index].narrow(0, hp.start, hp.numel).copy_(piece)
    for index, flat in enumerate(flats):
        base.state[flat] = {"step": _step_value(base, step), **{key: moments[key][index] for key in MOMENT_KEYS}}
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        optimizer._hp_optimizer_states_linked = False  # the moment views are re-linked at the next step


@torch.no_grad()
def fill_zero3(optimizer, named: dict, source, step: int) -> None:
    """ZeRO-3: rank r holds elements [r*P, (r+1)*P) of each flattened parameter (the last share
    zero-padded), as the low-precision `ds_tensor` and at `grad_position` in its group's fp32 flat."""
    if getattr(optimizer, "swap_optimizer", False) or getattr(optimizer, "params_in_nvme_and_cpu", False):
        raise ValueError("loading a full state into ZeRO-3 with NVMe offload is not supported")
    base, flats = optimizer.optimizer, optimizer.fp32_partitioned_groups_flat
    moments = {key: [torch.zeros_like(flat) for flat in flats] for key in MOMENT_KEYS}
    optimizer.checkpoint_event_prologue()  # every parameter partitioned: the shares below are all that holds it
    for name, parameter in named.items():
        group = getattr(parameter, "ds_process_group", optimizer.dp_process_group)
        rank, ranks = torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
        share = parameter.ds_tensor.numel()
        index, offset, numel = optimizer.grad_position[optimizer.get_param_id(parameter)]

        def piece(key: str, name=name, share=share, ranks=ranks, rank=rank) -> torch.Tensor:  # bound now (B023)
            flat = source.tensor(key, name).flatten()
            return torch.nn.functional.pad(flat, (0, share * ranks - flat.numel())).narrow(0, rank * share, share)

        weights = piece("fp32")
        parameter.ds_tensor.copy_(weights.to(parameter.ds_tensor.device, parameter.ds_tensor.dtype))
        flats[index].narrow(0, offset, numel).copy_(weights[:numel])
        for key in MOMENT_KEYS:
            moments[key][index].narrow(0, offset, numel).copy_(piece(key)[:numel])
    for index, flat in enumerate(flats):
        base.state[flat] = {"step": _step_value(base, step), **{key: moments[key][index] for key in MOMENT_KEYS}}
    optimizer.checkpoint_event_epilogue()  # gathers the persistent (small, never partitioned) parameters again
