# Helpers shared by the launch scripts (sourced, not run).

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

# The config file CONFIG names: as given, or the shipped config its short form
# model_zoo/<model>/configs/X.yaml stands for (as `model-zoo train` reads it).
config_file() {  # CONFIG
    local path
    path=$("$PYTHON" -c "import sys; from model_zoo.config import shipped_config as s; print(s(sys.argv[1]))" "$1") \
        || fail "$PYTHON cannot import model_zoo (install it: pip install -e .)"
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

# CPU or Ascend: $DEVICE_TARGET when set, else Ascend when its backend loads.
device_target() {
    if [ -n "${DEVICE_TARGET:-}" ] && [ "$DEVICE_TARGET" != "auto" ]; then
        echo "$DEVICE_TARGET"
    else
        "$PYTHON" -c "from model_zoo.parallel.context import detect_device_target as d; print(d())" \
            2>/dev/null | tail -1
    fi
}
