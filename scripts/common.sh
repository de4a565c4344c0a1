# Helpers shared by the launch scripts (sourced, not run).

# The variables of the launch scripts (their banners say what each does) that were set
# when the script started, as `NAME=VALUE ...`: part of the command that continues the job.
LAUNCH_VARIABLES="DEVICE_TARGET SERVER_IP RANK_START HCCL_CONNECT_TIMEOUT HCCL_EXEC_TIMEOUT
FAILURE_GRACE_SECONDS JOB_TIMEOUT_SECONDS BIND_CORES RANK_WORKDIRS MAX_USER_PROCESSES PYTHON
MASTER_ADDR MASTER_PORT NODE_RANK LOCAL_WORKER_NUM CLUSTER_TIME_OUT MODEL_ZOO_CPU_THREADS"
LAUNCHED_WITH=""
for _name in $LAUNCH_VARIABLES; do
    [ -n "${!_name+x}" ] && LAUNCHED_WITH+="$_name=$(printf '%q' "${!_name}") "
done

PYTHON=${PYTHON:-python3}
DEFAULT_CONFIG=model_zoo/models/gpt2/configs/tiny.yaml
export GLOG_v=${GLOG_v:-3}

# The script's banner: its leading comment block.
usage() {
    sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

fail() {
    echo "error: $*" >&2
    exit 2
}

# The command line that started this script (`invocation "$0" "$@"`), runnable from a fresh
# shell: this folder, the launch variables that were set, the script and its arguments.
# The command that continues a stopped job is it with --resume.
invocation() {  # SCRIPT [ARGS...]
    local command
    command="cd $(printf '%q' "$PWD") && ${LAUNCHED_WITH}bash$(printf ' %q' "$@")"
    echo "$command"
}

# The config file CONFIG names: as given, or the shipped config its short form
# model_zoo/<model>/configs/X.yaml stands for (as `model-zoo train` reads it).
config_file() {  # CONFIG
    local path
    path=$("$PYTHON" -c "import sys; from model_zoo.config import shipped_config as s; print(s(sys.argv[1]))" "$1") \
        || fail "$PYTHON cannot import model_zoo (install it: pip install -e .)"
    [ -d "$path" ] && fail "config $1 is a directory, not a YAML file"
    [ -f "$path" ] || fail "config file $1 does not exist"
    echo "$path"
}

require_positive() {  # NAME VALUE
    case "$2" in
        ''|*[!0-9]*|0) fail "$1 must be a positive number, got '$2'" ;;
    esac
}

# The run's output folder: --output-dir from the train arguments, else the trainer's default.
output_dir_of() {  # CONFIG [train args]
    local config=$1 previous="" arg dir
    shift
    dir="outputs/$(basename "$config" .yaml)"
    for arg in "$@"; do
        case "$arg" in
            --output-dir=*) dir=${arg#--output-dir=} ;;
            --train-url=*|--train_url=*) dir=${arg#*=} ;;
        esac
        case "$previous" in
            --output-dir|--train-url|--train_url) dir=$arg ;;
        esac
        previous=$arg
    done
    echo "$dir"
}

# CPU or Ascend for this launch: $DEVICE_TARGET when set; else Ascend when MindSpore's
# Ascend backend loads, CPU workers when it does not and neither a rank table nor msrun
# asks for Ascend. A rank table, msrun (ASCEND_ONLY) or DEVICE_TARGET=Ascend on a machine
# where the backend does not load is refused, naming what is missing, instead of quietly
# training on the CPU; only a DRY_LAUNCH, which starts nothing, takes
# DEVICE_TARGET=Ascend on any machine.
launch_target() {  # RANK_TABLE (may be empty) [ASCEND_ONLY: what asks for Ascend]
    local requested=${DEVICE_TARGET:-auto} problem
    case "$requested" in
        CPU) echo CPU; return ;;
        Ascend|auto) ;;
        *) fail "DEVICE_TARGET must be CPU, Ascend or auto, got '$requested'" ;;
    esac
    if [ "$requested" = Ascend ] && [ -n "${DRY_LAUNCH:-}" ]; then
        echo Ascend
        return
    fi
    problem=$("$PYTHON" -c "from model_zoo.parallel.context import ascend_runtime_problem as p
print(p())" 2>/dev/null) || fail "$PYTHON cannot import model_zoo (install it: pip install -e .)"
    problem=$(echo "$problem" | tail -1)
    if [ -z "$problem" ]; then
        echo Ascend
    elif [ -n "$1" ] || [ -n "${2:-}" ] || [ "$requested" = Ascend ]; then
        fail "${1:+rank table $1 given, but }${2:+$2 on Ascend, but }no usable Ascend" \
             "runtime here: $problem (for CPU workers ${1:+give no rank table, or }set" \
             "DEVICE_TARGET=CPU)"
    else
        echo CPU
    fi
}

# Sets LAYOUT to the arguments the launch adds to `model-zoo train` to lay CONFIG out over
# DEVICE_NUM devices (model_zoo/plan/launch.py); on Ascend the layout is checked with the
# plan first. A layout that does not fit ends the script with its `error:` line.
launch_layout() {  # TARGET DEVICE_NUM CONFIG [train args]
    local added
    added=$("$PYTHON" -m model_zoo.plan.launch --target "$1" --device-num "$2" "$3" "${@:4}") \
        || exit $?
    LAYOUT=()
    [ -z "$added" ] || mapfile -t LAYOUT <<< "$added"
}

# A line about the launch: on stdout, or on stderr for a DRY_LAUNCH (whose stdout is the
# ranks' lines).
launch_note() {  # MESSAGE
    if [ -n "${DRY_LAUNCH:-}" ]; then echo "$1" >&2; else echo "$1"; fi
}

# Raise the per-user process limit as MindSpore's cluster scripts do (MAX_USER_PROCESSES,
# default unlimited; empty leaves it): a server's ranks start many threads each.
raise_process_limit() {
    local limit=${MAX_USER_PROCESSES-unlimited}
    [ -z "$limit" ] && return
    ulimit -u "$limit" 2>/dev/null \
        || echo "warning: could not set ulimit -u $limit (the limit stays $(ulimit -u))" >&2
}
