#!/usr/bin/env bash
# Create .venv and install AstrAI with its test extras. Safe to re-run.
# torch is pinned to 2.13.0 (the CPU wheel on the build machines); on a GPU host install the
# CUDA build of torch 2.13.0 into the venv first and pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev]'
