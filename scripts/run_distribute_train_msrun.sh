#!/usr/bin/env bash
# Distributed training with MindSpore 2.x's msrun launcher (no rank table needed).
#
# Usage: bash scripts/run_distribute_train_msrun.sh WORKER_NUM [CONFIG] [args for `model-zoo train`]
#   WORKER_NUM  processes of the whole job (all nodes)
#   CONFIG      YAML config (default: model_zoo/models/gpt2/configs/tiny.yaml); on Ascend its layout
#               data_parallel x model_parallel x pipeline_stage must equal WORKER_NUM
#   e.g. one node:  bash scripts/run_distribute_train_msrun.sh 8 model_zoo/models/gpt2/configs/gpt2-small.yaml
#        two nodes: on node 0: MASTER_ADDR=10.0.0.1 NODE_RANK=0 LOCAL_WORKER_NUM=8 bash ... 16 CONFIG
#                   on node 1: MASTER_ADDR=10.0.0.1 NODE_RANK=1 LOCAL_WORKER_NUM=8 bash ... 16 CONFIG
#
# Environment: MASTER_ADDR (default 127.0.0.1: this node runs the scheduler), MASTER_PORT
# (default 8118), NODE_RANK (default 0), LOCAL_WORKER_NUM (default WORKER_NUM),
# CLUSTER_TIME_OUT (seconds to wait for all nodes, default 600), DEVICE_TARGET=CPU|Ascend
# (on CPU the job is data-parallel over WORKER_NUM processes).
# msrun writes logs to OUTPUT_DIR/msrun_logs/worker_<rank>.log and waits for the job; it
# starts the workers with the first `python3` on PATH (it accepts no other interpreter name).
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 1
fi
WORKER_NUM=$1
shift
CONFIG=$DEFAULT_CONFIG
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    CONFIG=$1
    shift
fi
require_positive WORKER_NUM "$WORKER_NUM"
CONFIG=$(config_file "$CONFIG")

OUTPUT_DIR=$(output_dir_of "$CONFIG" "$@")
TARGET=$(device_target)
layout=()
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}
if [ "$TARGET" != "Ascend" ]; then
    export DEVICE_TARGET=CPU
    layout=(--set "parallel.data_parallel=$WORKER_NUM")
    # each local worker's share of the cores for the CPU kernels' threads, as the CPU
    # launcher gives it
    require_positive LOCAL_WORKER_NUM "${LOCAL_WORKER_NUM:-$WORKER_NUM}"
    share=$("$PYTHON" -c "import sys; from model_zoo.launch.local import cpu_threads_share as s
print(s(int(sys.argv[1])))" "${LOCAL_WORKER_NUM:-$WORKER_NUM}")
    export MODEL_ZOO_CPU_THREADS=${MODEL_ZOO_CPU_THREADS:-$share}
fi

exec msrun --worker_num="$WORKER_NUM" --local_worker_num="${LOCAL_WORKER_NUM:-$WORKER_NUM}" \
    --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-8118}" \
    --node_rank="${NODE_RANK:-0}" --log_dir="$OUTPUT_DIR/msrun_logs" --join=True \
    --cluster_time_out="${CLUSTER_TIME_OUT:-600}" \
    python3 -m model_zoo train "$CONFIG" ${layout[@]+"${layout[@]}"} "$@"
