# What a script needs, checked before it does anything: sourced by the scripts users run
# (deploy/ray/try_local.sh, bench/gpu/run.sh, bench/cpu/*.sh, mtp/runs/*.sh).
#
#   need CMD HOW          CMD (a command on PATH, or a path) is there; HOW: how to install it
#   need_root WHY         the script runs as root
#   need_files GLOB HOW   at least one file matches GLOB
#   need_gpu_machine      what the device scripts need (below)
#   require_done          stop (status 1) when anything above was missing, having printed one
#                         line each, e.g. "rsync not found: install it (apt-get install rsync)"
#
# Every check runs before `require_done`, so one run names everything that is missing.

_require_missing=0

need() {
  if [[ $1 == */* ]]; then [[ -x $1 ]] && return 0; else command -v "$1" > /dev/null 2>&1 && return 0; fi
  echo "$1 not found: install it ($2)" >&2
  _require_missing=1
}

need_root() {
  [[ $(id -u) == 0 ]] && return 0
  echo "must run as root: $1" >&2
  _require_missing=1
}

need_files() {
  compgen -G "$1" > /dev/null && return 0
  echo "$1 not found: $2" >&2
  _require_missing=1
}

# The device script (bench/gpu/run.sh): python3 with pip, an NVIDIA GPU's driver (the wheels it
# lacks come in the carried bundle: bench/gpu/bundle.sh).
need_gpu_machine() {
  need python3 "apt-get install python3 python3-pip"
  need nvidia-smi "the NVIDIA driver's utilities, nvidia-utils-VERSION, on a machine with an NVIDIA GPU"
}

require_done() {
  [[ $_require_missing == 0 ]] || exit 1
}
