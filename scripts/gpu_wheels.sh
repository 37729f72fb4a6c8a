#!/usr/bin/env bash
# Fill .whl/ with the wheels that scripts/gpu_check.sh installs on a device machine (Python 3.12, x86-64, no
# network, its own torch and transformers 5.17): the packages AstrAI needs that its image lacks or holds at an
# older version, pinned to the versions of this .venv. Recipe of /work/.library/device/README.md (pip download,
# cp312, manylinux, --no-deps); DeepSpeed is an sdist, built here into a pure-Python wheel (its ops are compiled
# on first use there). Run from anywhere: bash scripts/gpu_wheels.sh; then run the check with carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# Missing there: deepspeed (+ hjson, pydantic and its parts), datasets (+ dill, multiprocess). Older there:
# transformers (5.17; constraints.txt pins 5.24, pyproject.toml's floor) and what 5.24 checks at import (regex);
# typing-extensions (pydantic-core needs >= 4.16); peft and accelerate, so the device runs the versions the suite
# ran here (this .venv's, which scripts/setup.sh installs from constraints.txt).
PACKAGES=(hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions datasets dill multiprocess
  transformers regex peft accelerate)
pinned() { "$PY" -c "from importlib.metadata import version; print(version('$1'))"; }

rm -rf .whl && mkdir -p .whl
specs=()
for name in "${PACKAGES[@]}"; do specs+=("$name==$(pinned "$name")"); done
echo "downloading: ${specs[*]}"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"
echo "building: deepspeed==$(pinned deepspeed)"
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w .whl "deepspeed==$(pinned deepspeed)"

# One version of each package, or the install there stops (README: "Keep one version of each").
dupes=$(ls .whl | sed 's/-[0-9].*//' | tr 'A-Z-' 'a-z_' | sort | uniq -d)
[ -z "$dupes" ] || { echo "two versions of: $dupes" >&2; exit 1; }
ls -l .whl | awk 'NR > 1 {printf "%8.1f KiB  %s\n", $5 / 1024, $9}'
echo "total: $(du -sh .whl | cut -f1) in $(ls .whl | wc -l) wheels (the tree that travels must stay under 64 MiB)"
# .whl/ never enters git: the main checkout's exclude (shared by every worktree) ignores it.
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
