#!/usr/bin/env bash
# Distributed training with MindSpore's msrun launcher (no rank table needed): the first
# choice for jobs of one or several servers.
#
# Usage: bash scripts/run_distribute_train_msrun.sh WORKER_NUM [CONFIG] [args for `model-zoo train`]
#   WORKER_NUM  processes of the whole job (all nodes)
#   CONFIG      YAML config (default: model_zoo/models/gpt2/configs/tiny.yaml). A config laid
#               out for fewer devices gets the data-parallel replicas that fill WORKER_NUM;
#               on Ascend the layout is checked with `model-zoo plan` before msrun starts
#   e.g. one node:  bash scripts/run_distribute_train_msrun.sh 8 model_zoo/models/gpt2/configs/gpt2-small.yaml
#        two nodes: on node 0: MASTER_ADDR=10.0.0.1 NODE_RANK=0 LOCAL_WORKER_NUM=8 bash ... 16 CONFIG
#                   on node 1: MASTER_ADDR=10.0.0.1 NODE_RANK=1 LOCAL_WORKER_NUM=8 bash ... 16 CONFIG
#
# The script waits for the job. SIGINT or SIGTERM to it (Ctrl-C) makes every worker of this
# node save a checkpoint and stop; when the job stops before its end the script prints the
# command that continues it (this command with --resume). Logs:
# OUTPUT_DIR/msrun_logs/worker_<rank>.log; msrun starts the workers with the first
# `python3` on PATH (it accepts no other interpreter name).
# Environment: MASTER_ADDR (default 127.0.0.1: this node runs the scheduler), MASTER_PORT
# (default 8118), NODE_RANK (default 0), LOCAL_WORKER_NUM (default WORKER_NUM; a job of more
# than 8 workers, or fewer local ones, runs on several servers and needs all three set),
# CLUSTER_TIME_OUT (seconds to wait for all nodes, default 7200 as MindFormers' launcher),
# DEVICE_TARGET=CPU|Ascend (on CPU the job is data-parallel over WORKER_NUM processes; a
# machine without Ascend is refused unless DEVICE_TARGET=CPU), DRY_LAUNCH=1 (print each
# local rank's environment and command, `rank R device D: ENV=VALUE ... COMMAND`, then the
# msrun command, and start nothing), BIND_CORES=0 (no msrun --bind_core on Ascend),
# RANK_WORKDIRS=0 (on Ascend each worker otherwise makes its own CANN working folder and
# compile cache, OUTPUT_DIR/rank_<rank>/ascend_work and compile_cache), MAX_USER_PROCESSES
# (ulimit -u on Ascend, default unlimited), HCCL_CONNECT_TIMEOUT, HCCL_EXEC_TIMEOUT.
set -euo pipefail
source "$(dirname "$0")/common.sh"

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    exit 1
fi
AGAIN=$(invocation "$0" "$@")
WORKER_NUM=$1
shift
CONFIG=$DEFAULT_CONFIG
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    CONFIG=$1
    shift
fi
require_positive WORKER_NUM "$WORKER_NUM"
# A job of more workers than one server holds (8 devices), or fewer local workers than the
# job's, runs on several servers: each must say which it is and what it starts, as
# MindFormers' msrun_launcher.sh asks, or the others wait CLUSTER_TIME_OUT for it.
SERVER_DEVICES=8
LOCAL=${LOCAL_WORKER_NUM:-$WORKER_NUM}
require_positive LOCAL_WORKER_NUM "$LOCAL"
if [ "$LOCAL" -gt "$WORKER_NUM" ]; then
    fail "LOCAL_WORKER_NUM $LOCAL is more than the job's WORKER_NUM $WORKER_NUM"
fi
if [ "$LOCAL" -lt "$WORKER_NUM" ] \
        || { [ "$WORKER_NUM" -gt "$SERVER_DEVICES" ] && [ -z "${LOCAL_WORKER_NUM:-}" ]; }; then
    missing=""
    for name in NODE_RANK LOCAL_WORKER_NUM MASTER_ADDR; do
        [ -n "${!name:-}" ] || missing+="${missing:+, }$name"
    done
    [ -z "$missing" ] || fail "a job of $WORKER_NUM workers runs on several servers (one" \
        "holds $SERVER_DEVICES): set $missing on each (MASTER_ADDR the first server's" \
        "address, NODE_RANK 0, 1, ... and LOCAL_WORKER_NUM its workers), or, on a server" \
        "of $WORKER_NUM devices (or CPU workers), LOCAL_WORKER_NUM=$WORKER_NUM"
    case "$NODE_RANK" in
        ''|*[!0-9]*) fail "NODE_RANK must be 0, 1, ..., got '$NODE_RANK'" ;;
    esac
    # msrun numbers a server's workers NODE_RANK x LOCAL_WORKER_NUM + i: every server the same
    [ $(( WORKER_NUM % LOCAL )) -eq 0 ] || fail "WORKER_NUM $WORKER_NUM is not a multiple" \
        "of LOCAL_WORKER_NUM $LOCAL: msrun needs as many workers on every server"
    [ "$NODE_RANK" -lt $(( WORKER_NUM / LOCAL )) ] || fail "NODE_RANK $NODE_RANK is not" \
        "below the job's $(( WORKER_NUM / LOCAL )) servers of $LOCAL workers"
fi
NODE=${NODE_RANK:-0}
CONFIG=$(config_file "$CONFIG")
OUTPUT_DIR=$(output_dir_of "$CONFIG" "$@")
TARGET=$(launch_target "" msrun)
if [ "$TARGET" != Ascend ]; then
    launch_note "no Ascend: starting $LOCAL data-parallel CPU workers through msrun (logs in $OUTPUT_DIR/msrun_logs/)"
fi
launch_layout "$TARGET" "$WORKER_NUM" "$CONFIG" "$@"
TRAIN=(python3 -m model_zoo train "$CONFIG" "$@" ${LAYOUT[@]+"${LAYOUT[@]}"})
MSRUN=(msrun "--worker_num=$WORKER_NUM" "--local_worker_num=$LOCAL"
       "--master_addr=${MASTER_ADDR:-127.0.0.1}" "--master_port=${MASTER_PORT:-8118}"
       "--node_rank=$NODE" "--log_dir=$OUTPUT_DIR/msrun_logs" --join=True
       "--cluster_time_out=${CLUSTER_TIME_OUT:-7200}")
JOB_ENV=("DEVICE_TARGET=$TARGET" "GLOG_v=$GLOG_v")
if [ "$TARGET" = Ascend ]; then
    JOB_ENV+=("HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}"
              "HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}")
    [ "${BIND_CORES:-1}" != 0 ] && MSRUN+=(--bind_core=True)
    # each worker's own CANN working folder, made by the worker (launch/local.py
    # use_rank_workdirs): msrun gives all of them one environment
    [ "${RANK_WORKDIRS:-1}" != 0 ] \
        && JOB_ENV+=("MODEL_ZOO_RANK_WORKDIRS=$(realpath -m "$OUTPUT_DIR")")
else
    # each local worker's share of the cores for the CPU kernels' threads, as the CPU
    # launcher gives it
    share=$("$PYTHON" -c "import sys; from model_zoo.launch.local import cpu_threads_share as s
print(s(int(sys.argv[1])))" "$LOCAL")
    JOB_ENV+=("MODEL_ZOO_CPU_THREADS=${MODEL_ZOO_CPU_THREADS:-$share}")
fi

if [ -n "${DRY_LAUNCH:-}" ]; then
    # what msrun gives each worker of this node (process_entity/_api.py of MindSpore 2.x):
    # a single node numbers its workers from 0 whatever NODE_RANK says
    for ((i = 0; i < LOCAL; i++)); do
        rank=$(( LOCAL == WORKER_NUM ? i : NODE * LOCAL + i ))
        words=("${JOB_ENV[@]}" MS_ROLE=MS_WORKER "MS_SCHED_HOST=${MASTER_ADDR:-127.0.0.1}"
               "MS_SCHED_PORT=${MASTER_PORT:-8118}" "MS_WORKER_NUM=$WORKER_NUM"
               "MS_TOPO_TIMEOUT=${CLUSTER_TIME_OUT:-7200}" "MS_NODE_ID=$rank" "RANK_ID=$rank"
               "DEVICE_ID=$i" "RANK_SIZE=$WORKER_NUM" "${TRAIN[@]}")
        echo "rank $rank device $i:$(printf ' %q' "${words[@]}")"
    done
    echo "msrun:$(printf ' %q' "${JOB_ENV[@]}" "${MSRUN[@]}" "${TRAIN[@]}")"
    exit 0
fi

export "${JOB_ENV[@]}"
[ "$TARGET" = Ascend ] && raise_process_limit
mkdir -p "$OUTPUT_DIR"
# msrun in a session of its own, so that a Ctrl-C reaches only this script, which asks the
# workers to save and stop: msrun itself answers SIGINT by killing every worker at once
starter=()
command -v setsid >/dev/null && starter=(setsid)
# msrun starts each worker in a session of its own (the workers lead their sessions;
# its scheduler and log tails do not)
workers() {
    ps -eo pid=,ppid=,sid= | awk -v parent="$MSRUN_PID" '$2 == parent && $1 == $3 { print $1 }'
}
# the first signal asks each worker to save and stop; a second one, or one before any
# worker started, ends them (and msrun) at once
forward() {  # SIGNAL
    local pid pids again=${SIGNAL:+yes}
    SIGNAL=${SIGNAL:-$1}
    [ -z "$MSRUN_PID" ] && exit $(( 128 + $(kill -l "$1") ))
    pids=$(workers)
    if [ -z "$pids" ] || [ -n "$again" ]; then
        echo "received SIG$1: stopping every worker of this node at once" >&2
        for pid in $pids; do kill -KILL -- "-$pid" 2>/dev/null || true; done
        kill -TERM -- "-$MSRUN_PID" 2>/dev/null || kill -TERM "$MSRUN_PID" 2>/dev/null || true
        return
    fi
    echo "received SIG$1: asking every worker of this node to save a checkpoint and stop" \
         "(send it again to stop them at once)" >&2
    for pid in $pids; do
        kill -s "$1" -- "-$pid" 2>/dev/null || true
    done
}
SIGNAL=""
MSRUN_PID=""
trap 'forward INT' INT
trap 'forward TERM' TERM
${starter[@]+"${starter[@]}"} "${MSRUN[@]}" "${TRAIN[@]}" &
MSRUN_PID=$!
status=0
while true; do
    wait "$MSRUN_PID" && status=0 || status=$?
    kill -0 "$MSRUN_PID" 2>/dev/null || break   # else a trapped signal ended the wait
done
trap - INT TERM
if [ -n "$SIGNAL" ]; then
    status=$(( 128 + $(kill -l "$SIGNAL") ))
    echo "the workers saved a checkpoint and stopped; continue the job with: $AGAIN --resume"
elif [ "$status" != 0 ]; then
    echo "the job failed (msrun exited with $status; logs in $OUTPUT_DIR/msrun_logs/); once" \
         "the failure is mended, continue the job with: $AGAIN --resume" >&2
fi
exit "$status"
