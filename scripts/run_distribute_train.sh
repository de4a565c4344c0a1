#!/usr/bin/env bash
# Distributed training on one server: one process per device.
#
# Usage: bash scripts/run_distribute_train.sh DEVICE_NUM [RANK_TABLE_FILE] [CONFIG] [args for `model-zoo train`]
#   DEVICE_NUM       devices of the whole job (all servers): 1, 2, 4, 8, 16, ...
#   RANK_TABLE_FILE  HCCL rank table (JSON v1.0) listing them; see rank_tables/. Ascend needs
#                    it; CPU workers do not (checked when given). Any path but a .yaml/.yml
#                    config is taken as the rank table
#   CONFIG           YAML config (default: model_zoo/models/gpt2/configs/tiny.yaml); on Ascend its
#                    layout data_parallel x model_parallel x pipeline_stage must equal DEVICE_NUM
#   e.g. bash scripts/run_distribute_train.sh 8 rank_tables/rank_table_8p.json \
#            model_zoo/models/gpt2/configs/gpt2-small.yaml --output-dir outputs/small
#        bash scripts/run_distribute_train.sh 2 model_zoo/gpt2/configs/tiny.yaml   # 2 CPU workers
#
# Ascend: the rank table is validated first; each of this server's devices gets a working
# folder OUTPUT_DIR/rank_<RANK_ID>/ with env.txt and train.log, and a launcher in the
# background starts one process per device and watches them: when one fails it stops the
# others within FAILURE_GRACE_SECONDS and names it in OUTPUT_DIR/launcher.log; a SIGTERM to
# the launcher's pid makes every rank save a checkpoint and stop. Several servers: run the
# script on each; this server's devices are found from its address in the table, or set
# SERVER_IP or RANK_START (the first rank id of this server).
# CPU (no Ascend, or DEVICE_TARGET=CPU): DEVICE_NUM data-parallel workers on this machine
# through MindSpore's dynamic cluster; the script waits, and fails naming the rank if one
# fails, within FAILURE_GRACE_SECONDS (default 10).
# Environment: DEVICE_TARGET=CPU|Ascend, SERVER_IP, RANK_START, HCCL_CONNECT_TIMEOUT
# (seconds the ranks wait for each other to connect, default 1200: big graphs compile
# first), HCCL_EXEC_TIMEOUT (seconds a collective waits for its peers, default 1800),
# FAILURE_GRACE_SECONDS (default 10), JOB_TIMEOUT_SECONDS (default none), PYTHON.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 1
fi
DEVICE_NUM=$1
shift
require_positive DEVICE_NUM "$DEVICE_NUM"
RANK_TABLE=""
case "${1:-}" in   # a rank table unless it is a YAML config or an option
    ''|-*|*.yaml|*.yml) ;;
    *) RANK_TABLE=$1; shift ;;
esac
CONFIG=$DEFAULT_CONFIG
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    CONFIG=$1
    shift
fi
CONFIG=$(config_file "$CONFIG")
TARGET=$(device_target)
if [ -n "$RANK_TABLE" ]; then
    [ -f "$RANK_TABLE" ] || fail "rank table $RANK_TABLE does not exist"
    "$PYTHON" -m model_zoo rank-table validate "$RANK_TABLE" --device-num "$DEVICE_NUM" >/dev/null
elif [ "$TARGET" = "Ascend" ]; then
    fail "Ascend needs the HCCL rank table after DEVICE_NUM; see rank_tables/"
fi
OUTPUT_DIR=$(output_dir_of "$CONFIG" "$@")

if [ "$TARGET" != "Ascend" ]; then
    echo "no Ascend device: starting $DEVICE_NUM data-parallel CPU workers (logs in $OUTPUT_DIR/rank_<i>/train.log)"
    export DEVICE_TARGET=CPU
    exec "$PYTHON" -m model_zoo.launch --workers "$DEVICE_NUM" --output-dir "$OUTPUT_DIR" \
        --grace "${FAILURE_GRACE_SECONDS:-10}" --timeout "${JOB_TIMEOUT_SECONDS:-0}" -- \
        "$PYTHON" -m model_zoo train "$CONFIG" --set "parallel.data_parallel=$DEVICE_NUM" "$@"
fi

# Ascend: one process per device of this server, started and watched by the launcher.
locate=()
[ -n "${SERVER_IP:-}" ] && locate+=(--server-ip "$SERVER_IP")
[ -n "${RANK_START:-}" ] && locate+=(--rank-start "$RANK_START")
DEVICES=$("$PYTHON" -m model_zoo rank-table devices "$RANK_TABLE" ${locate[@]+"${locate[@]}"})

export RANK_TABLE_FILE
RANK_TABLE_FILE=$(cd "$(dirname "$RANK_TABLE")" && pwd)/$(basename "$RANK_TABLE")
export RANK_SIZE=$DEVICE_NUM
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}
export DEVICE_TARGET=Ascend
pairs=""
while read -r device_id rank_id; do
    rank_dir="$OUTPUT_DIR/rank_$rank_id"
    mkdir -p "$rank_dir"
    { echo "=== rank $rank_id (device $device_id) $(date '+%Y-%m-%d %H:%M:%S')";
      env DEVICE_ID="$device_id" RANK_ID="$rank_id" | sort; } >> "$rank_dir/env.txt"
    pairs="${pairs:+$pairs,}$device_id:$rank_id"
    echo "rank $rank_id on device $device_id: log $rank_dir/train.log"
done <<< "$DEVICES"
nohup "$PYTHON" -m model_zoo.launch --devices "$pairs" --output-dir "$OUTPUT_DIR" \
    --grace "${FAILURE_GRACE_SECONDS:-10}" --timeout "${JOB_TIMEOUT_SECONDS:-0}" -- \
    "$PYTHON" -m model_zoo train "$CONFIG" "$@" >> "$OUTPUT_DIR/launcher.log" 2>&1 &
echo "started; the launcher (pid $!) stops every rank if one fails, and a 'kill -TERM $!'"
echo "makes them save a checkpoint and stop; its log: $OUTPUT_DIR/launcher.log"
echo "follow a rank with: tail -f $OUTPUT_DIR/rank_<RANK_ID>/train.log"
