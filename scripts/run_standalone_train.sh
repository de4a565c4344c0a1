#!/usr/bin/env bash
# Train one model in one process (a CPU, or one Ascend device).
#
# Usage: bash scripts/run_standalone_train.sh CONFIG [args for `model-zoo train`]
#   e.g. bash scripts/run_standalone_train.sh model_zoo/models/gpt2/configs/tiny.yaml \
#            --output-dir outputs/tiny --set train.steps=500
# Environment: DEVICE_TARGET=CPU|Ascend (default: Ascend when its backend loads),
#              DEVICE_ID (Ascend device to use), PYTHON (default python3).
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 1
fi
CONFIG=$1
shift
CONFIG=$(config_file "$CONFIG")
exec "$PYTHON" -m model_zoo train "$CONFIG" "$@"
