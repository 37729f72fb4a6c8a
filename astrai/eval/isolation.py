"""An eval must not change the run it measures: no gradients, the model in eval mode only for the eval, and
every random generator the eval could draw from restored afterwards, so that a run with eval follows exactly the
trajectory of the same run without it (tests/unit/eval/ checks per-step losses and final weights bit for bit)."""

from __future__ import annotations

import contextlib
import random

import numpy
import torch


@contextlib.contextmanager
def preserved_rng(device: torch.device):
    """Python's `random`, numpy, torch's CPU generator and (on CUDA) the device's generator are as they were
    before the block, whatever it drew."""
    python_state, numpy_state = random.getstate(), numpy.random.get_state()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(python_state)
            numpy.random.set_state(numpy_state)


@contextlib.contextmanager
def evaluating(engines, device: torch.device):
    """No gradients, every engine in eval mode (no dropout) and the RNG preserved, for the block; the engines go
    back to train mode after it."""
    with preserved_rng(device), torch.no_grad():
        for engine in engines:
            engine.eval()
        try:
            yield
        finally:
            for engine in engines:
                engine.train()
