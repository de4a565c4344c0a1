#!/usr/bin/env bash
# Train one model in one process (a CPU, or one Ascend device).
#
# Usage: bash scripts/run_standalone_train.sh CONFIG [args for `model-zoo train`]
#   e.g. bash scripts/run_standalone_train.sh model_zoo/models/gpt2/configs/tiny.yaml \
#            --output-dir outputs/tiny --set train.steps=500
# Environment: DEVICE_TARGET=CPU|Ascend (default: Ascend when its backend loads),
#              DEVICE_ID (Ascend device to use), PYTHON (default python3), DRY_LAUNCH=1
#              (print `rank 0 device D: ENV=VALUE ... COMMAND` and start nothing).
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 1
fi
CONFIG=$1
shift
CONFIG=$(config_file "$CONFIG")
TRAIN=("$PYTHON" -m model_zoo train "$CONFIG" "$@")
if [ -n "${DRY_LAUNCH:-}" ]; then
    echo "rank 0 device ${DEVICE_ID:-0}:$(printf ' %q' "GLOG_v=$GLOG_v" "${TRAIN[@]}")"
    exit 0
fi
exec "${TRAIN[@]}"
