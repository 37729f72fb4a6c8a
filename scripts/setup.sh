#!/usr/bin/env bash
# Create .venv and install AstrAI with its test extras, at the exact versions of constraints.txt (the set the
# suite passed with; pyproject.toml declares ranges). Safe to re-run. torch is pinned there to 2.13.0, the CPU
# wheel on the build machines; on a GPU host install the CUDA build of torch 2.13.0 into the venv first and pip
# keeps it (constraints.txt's torch==2.13.0 admits 2.13.0+cu128).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
