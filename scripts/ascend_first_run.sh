#!/usr/bin/env bash
# A few minutes' check of an Ascend server before a long job: three drills on two of its
# devices, each printing PASS or what differed (model_zoo/launch/first_run.py):
#   1. one step with train.grad_accumulation 4 against 1 on the same global batch: equal
#      gradient norms;
#   2. GPT-2 tiny on a 2-stage pipeline, 3 steps, HCCL_EXEC_TIMEOUT=120: no hang;
#   3. an fp16 overflow: skipped, and the loss scale halved, on every rank.
#
# Usage: bash scripts/ascend_first_run.sh [--cpu] [--output-dir DIR]
#   --cpu         the same drills on this machine's CPU (as the tests run them)
#   --output-dir  where the jobs write (default outputs/first_run)
# Exit status: 0 when every drill passed, 1 otherwise, 2 for bad input.
# Environment: PYTHON (default python3); the jobs start through
# scripts/run_distribute_train_msrun.sh (MASTER_PORT, HCCL_CONNECT_TIMEOUT, ...).
set -euo pipefail
source "$(dirname "$0")/common.sh"
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    usage
    exit 1
fi
exec "$PYTHON" -m model_zoo.launch.first_run "$@"
