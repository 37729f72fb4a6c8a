#!/usr/bin/env bash
# scripts/train.sh {build|run|up|down|logs|status} [JOB_YAML]   (or TRAIN_CONFIG_FILE=JOB_YAML)
#
# The trainer container of docker/docker-compose.yml, driven by one job YAML: its infra: section
# names the host folders, GPUs and image, and wins over .env.train (or TRAIN_ENV_FILE), which fills
# in what the YAML leaves out. Guide: docs/developer/docker-training.md.
#   build   build the image (the only command that builds: run and up reuse it)
#   run     run the job in the foreground; the container is removed when it ends
#   up      start the job in the background (then logs, status, down)
#   down    stop and remove the job's container
#   logs    follow the job's output
#   status  show the job's container
# plan_* variables come from `eval` of the runtime helpers' output, which shellcheck cannot follow.
# shellcheck disable=SC2154
set -euo pipefail
WRAPPER=train.sh
# shellcheck source-path=SCRIPTDIR source=docker/lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/docker/lib/common.sh"

usage() { sed -n '2,12s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }

# Exports the infra: variables (TRAIN_*, CUDA_VISIBLE_DEVICES) and sets plan_* (project, image, and with
# `launch` the output folder and the resume check).
load_infra() {
  local launch=${1:-}
  if [ -n "$JOB_FILE" ]; then eval_runtime train_runtime.py exports "$JOB_FILE"; fi
  local plan_options=(--env-file "$ENV_FILE")
  if [ -n "$launch" ]; then plan_options+=(--launch); fi
  eval_runtime train_runtime.py plan ${JOB_FILE:+"$JOB_FILE"} "${plan_options[@]}"
}

require_image() {
  docker image inspect "$plan_image" >/dev/null 2>&1 ||
    die "image $plan_image is not on this host: build it with scripts/train.sh build $JOB_FILE (run and up never build)"
}

# `python -m astrai verify` with the repo's venv (or ASTRAI_VERIFY_PYTHON) when there is one, else inside the image.
verify_checkpoint() {
  local target=$1 python=${ASTRAI_VERIFY_PYTHON:-}
  shift
  if [ -z "$python" ] && [ -x "$REPO/.venv/bin/python" ]; then python=$REPO/.venv/bin/python; fi
  if [ -n "$python" ] && [ "$python" != image ]; then
    PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$python" -m astrai verify "$@" "$target"
  else
    local mounted
    mounted=/check/$(basename "$target")
    docker run --rm --entrypoint python -v "$target:$mounted:ro" "$plan_image" -m astrai verify "$@" "$mounted"
  fi
}

# A resume must not start from a checkpoint lacking a part this train type loads (online_ppo: the critic).
check_resume() {
  [ -n "$plan_resume_dir" ] || return 0
  if [ "${TRAIN_SKIP_RESUME_CHECK:-0}" = 1 ]; then
    warn "TRAIN_SKIP_RESUME_CHECK=1: not checking $plan_resume_dir"
    return 0
  fi
  local options=(--quick --require-parts "$plan_resume_parts") status=0
  if [ "$plan_resume_latest" = 1 ]; then options+=(--latest); fi
  verify_checkpoint "$plan_resume_dir" "${options[@]}" || status=$?
  case $status in
    0) ;;
    3) warn "resuming from a legacy checkpoint (no manifest): its files cannot be checked" ;;
    *) die "not launching: the checkpoint to resume from in $plan_resume_dir is not complete for train_type" \
         "$plan_train_type (needs $plan_resume_parts). Fix or remove it, or set checkpoint.resume in the job YAML;" \
         "TRAIN_SKIP_RESUME_CHECK=1 skips this check" ;;
  esac
}

main() {
  local command=${1:-}
  case $command in
    build | run | up | down | logs | status) shift ;;
    -h | --help) usage; return 0 ;;
    *) usage >&2; return 2 ;;
  esac
  [ $# -le 1 ] || die "$command takes one job YAML at most, got: $*"
  need_host_python
  resolve_job_file "${1:-}" "$([ "$command" = build ] && echo optional)"
  case $command in
    build)
      load_infra
      docker build -f "$REPO/docker/Dockerfile" --target gpu -t "$plan_image" "$REPO" ;;
    run | up)
      load_infra launch
      require_image
      check_resume
      mkdir -p "$plan_checkpoint_dir"  # made by us, not by the docker daemon as root
      if [ "$command" = run ]; then
        compose run --rm trainer
      else
        compose up -d trainer
        echo "$WRAPPER: started $plan_project; follow it with: scripts/train.sh logs $JOB_FILE"
      fi ;;
    down) load_infra; compose down ;;
    logs) load_infra; compose logs -f trainer ;;
    status) load_infra; compose ps -a trainer ;;
  esac
}

main "$@"
