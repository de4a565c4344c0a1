#!/usr/bin/env bash
# Distributed training on one server: one process per device.
#
# Usage: bash scripts/run_distribute_train.sh DEVICE_NUM [RANK_TABLE_FILE] [CONFIG] [args for `model-zoo train`]
#   DEVICE_NUM       devices of the whole job (all servers): 1, 2, 4, 8, 16, ...
#   RANK_TABLE_FILE  HCCL rank table (JSON v1.0) listing them; see rank_tables/. Giving one
#                    means Ascend: on a machine where Ascend does not load the script refuses
#                    it. Any path but a .yaml/.yml config is taken as the rank table
#   CONFIG           YAML config (default: model_zoo/models/gpt2/configs/tiny.yaml). A config
#                    laid out for fewer devices gets the data-parallel replicas that fill
#                    DEVICE_NUM (--set parallel.data_parallel=N is added); on Ascend the
#                    layout is checked with `model-zoo plan` before any rank starts
#   e.g. bash scripts/run_distribute_train.sh 8 rank_tables/rank_table_8p.json \
#            model_zoo/models/gpt2/configs/gpt2-small.yaml --output-dir outputs/small
#        bash scripts/run_distribute_train.sh 2 model_zoo/gpt2/configs/tiny.yaml   # 2 CPU workers
#
# Ascend: the rank table is validated first; each of this server's devices gets a folder
# OUTPUT_DIR/rank_<RANK_ID>/ with env.txt, train.log and its own CANN working folder, runs
# bound to its share of the cores, and a launcher in the background starts one process per
# device and watches them: when one fails it stops the others within FAILURE_GRACE_SECONDS
# and names it in OUTPUT_DIR/launcher.log; a SIGTERM to the launcher's pid makes every rank
# save a checkpoint and stop. launcher.log then gives the command that continues the job
# (this command with --resume). Several servers: run the script on each; this server's
# devices are found from its address in the table, or set SERVER_IP or RANK_START (the
# first rank id of this server).
# CPU (no Ascend and no rank table, or DEVICE_TARGET=CPU): DEVICE_NUM data-parallel workers
# on this machine through MindSpore's dynamic cluster; the script waits, and fails naming
# the rank if one fails, within FAILURE_GRACE_SECONDS (default 10).
# Environment: DEVICE_TARGET=CPU|Ascend, DRY_LAUNCH=1 (print each rank's environment and
# command, `rank R device D: ENV=VALUE ... COMMAND`, and start nothing; with
# DEVICE_TARGET=Ascend on any machine), SERVER_IP, RANK_START, HCCL_CONNECT_TIMEOUT
# (seconds the ranks wait for each other to connect, default 1200: big graphs compile
# first), HCCL_EXEC_TIMEOUT (seconds a collective waits for its peers, default 1800),
# FAILURE_GRACE_SECONDS (default 10), JOB_TIMEOUT_SECONDS (default none), BIND_CORES=0 (do
# not bind ranks to cores), RANK_WORKDIRS=0 (one CANN working folder for the server),
# MAX_USER_PROCESSES (ulimit -u, default unlimited; empty: leave it), PYTHON.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 1
fi
AGAIN=$(invocation "$0" "$@")
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
if [ -n "$RANK_TABLE" ]; then
    [ -d "$RANK_TABLE" ] && fail "$RANK_TABLE is a directory: give a rank table file" \
        "(JSON) or a config (YAML)"
    [ -f "$RANK_TABLE" ] || fail "rank table $RANK_TABLE does not exist"
    "$PYTHON" -m model_zoo rank-table validate "$RANK_TABLE" --device-num "$DEVICE_NUM" >/dev/null
fi
NO_TABLE="Ascend needs the HCCL rank table after DEVICE_NUM; see rank_tables/"
[ "${DEVICE_TARGET:-}" = Ascend ] && [ -z "$RANK_TABLE" ] && fail "$NO_TABLE"
TARGET=$(launch_target "$RANK_TABLE")
[ "$TARGET" = Ascend ] && [ -z "$RANK_TABLE" ] && fail "$NO_TABLE"
OUTPUT_DIR=$(output_dir_of "$CONFIG" "$@")
if [ "$TARGET" != Ascend ]; then
    launch_note "no Ascend: starting $DEVICE_NUM data-parallel CPU workers (logs in $OUTPUT_DIR/rank_<i>/train.log)"
fi
launch_layout "$TARGET" "$DEVICE_NUM" "$CONFIG" "$@"
TRAIN=("$PYTHON" -m model_zoo train "$CONFIG" "$@" ${LAYOUT[@]+"${LAYOUT[@]}"})
LAUNCH=("$PYTHON" -m model_zoo.launch --output-dir "$OUTPUT_DIR" --again "$AGAIN"
        --grace "${FAILURE_GRACE_SECONDS:-10}" --timeout "${JOB_TIMEOUT_SECONDS:-0}"
        --env "GLOG_v=$GLOG_v")
[ -n "${DRY_LAUNCH:-}" ] && LAUNCH+=(--dry-run)

if [ "$TARGET" != Ascend ]; then
    exec "${LAUNCH[@]}" --workers "$DEVICE_NUM" --env DEVICE_TARGET=CPU -- "${TRAIN[@]}"
fi

# Ascend: one process per device of this server, started and watched by the launcher.
locate=()
[ -n "${SERVER_IP:-}" ] && locate+=(--server-ip "$SERVER_IP")
[ -n "${RANK_START:-}" ] && locate+=(--rank-start "$RANK_START")
DEVICES=$("$PYTHON" -m model_zoo rank-table devices "$RANK_TABLE" ${locate[@]+"${locate[@]}"})
pairs=""
while read -r device_id rank_id; do
    pairs="${pairs:+$pairs,}$device_id:$rank_id"
done <<< "$DEVICES"
RANK_TABLE_FILE=$(cd "$(dirname "$RANK_TABLE")" && pwd)/$(basename "$RANK_TABLE")
LAUNCH+=(--devices "$pairs" --env "RANK_TABLE_FILE=$RANK_TABLE_FILE" --env "RANK_SIZE=$DEVICE_NUM"
         --env DEVICE_TARGET=Ascend --env "HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}"
         --env "HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}")
[ "${BIND_CORES:-1}" != 0 ] && LAUNCH+=(--bind-cores)
[ "${RANK_WORKDIRS:-1}" != 0 ] && LAUNCH+=(--rank-workdirs)
if [ -n "${DRY_LAUNCH:-}" ]; then
    exec "${LAUNCH[@]}" -- "${TRAIN[@]}"
fi
raise_process_limit
mkdir -p "$OUTPUT_DIR"
nohup "${LAUNCH[@]}" -- "${TRAIN[@]}" >> "$OUTPUT_DIR/launcher.log" 2>&1 &
while read -r device_id rank_id; do
    echo "rank $rank_id on device $device_id: log $OUTPUT_DIR/rank_$rank_id/train.log"
done <<< "$DEVICES"
echo "started; the launcher (pid $!) stops every rank if one fails, and a 'kill -TERM $!'"
echo "makes them save a checkpoint and stop; its log: $OUTPUT_DIR/launcher.log (which then"
echo "gives the command that continues the job)"
echo "follow a rank with: tail -f $OUTPUT_DIR/rank_<RANK_ID>/train.log"
