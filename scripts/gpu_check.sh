#!/usr/bin/env bash
# The GPU check (docs/gpu.md): on a machine with one GPU and no network, install the wheels
# `make gpu-wheels` prepared, then run the engine's CUDA path (full SmolLM2 at dp 1: fp32 and,
# where the engine has it, bf16; the cost model calibrated on CUDA; one rl_loop iteration where
# the engine has it) and write tokens/s, peak memory and the cost model to one JSON file.
# Under 10 minutes on one H200: the Python part is stopped after --limit seconds (default
# 480, so that the install and the check fit one 600 s device call).
#
#   scripts/gpu_check.sh [--wheels DIR] [--out JSON] [--steps N] [--quick] [--limit S]
#                        [--dry-run]
#
# --wheels  the folder of wheels (default build/gpu-wheels), installed with pip --no-index
#           --no-deps into a folder of its own (torch and the rest come from the machine)
# --out     the report (default $OUT/gpu_check.json when $OUT is set, else build/gpu_check.json)
# --dry-run print the steps, run nothing
# Exit status: the Python check's (0 every available part ran, 1 a part failed, 2 bad
# arguments); 2 for a bad argument here too.
set -euo pipefail

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }

WHEELS=build/gpu-wheels
REPORT=${OUT:+$OUT/gpu_check.json}
REPORT=${REPORT:-build/gpu_check.json}
STEPS=""
QUICK=""
LIMIT=480
DRY=0
PY=${PYTHON:-python3}
SITE=${VARBATCH_KIT_GPU_SITE:-/tmp/varbatch_kit_gpu_site}

while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) [ $# -ge 2 ] || die "--wheels needs a folder"; WHEELS=$2; shift 2 ;;
    --out) [ $# -ge 2 ] || die "--out needs a file"; REPORT=$2; shift 2 ;;
    --steps) [ $# -ge 2 ] || die "--steps needs a number"; STEPS=$2; shift 2 ;;
    --limit) [ $# -ge 2 ] || die "--limit needs seconds"; LIMIT=$2; shift 2 ;;
    --quick) QUICK=--quick; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
if [ -n "$STEPS" ] && ! [[ "$STEPS" =~ ^[1-9][0-9]*$ ]]; then
  die "--steps '$STEPS': give an integer >= 1"
fi
[[ "$LIMIT" =~ ^[1-9][0-9]*$ ]] || die "--limit '$LIMIT': give whole seconds >= 1"

# absolute paths: the check runs in a folder of its own (the installed wheel is imported,
# not a checkout the current folder may hold)
abspath() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }
WHEELS=$(abspath "$WHEELS")
REPORT=$(abspath "$REPORT")

step() {  # print a step; run it unless --dry-run
  echo "+ $*"
  if [ "$DRY" = 0 ]; then "$@"; fi
}

if [ "$DRY" = 0 ]; then
  [ -d "$WHEELS" ] || die "--wheels $WHEELS: no such folder (run \`make gpu-wheels\` where pip works)"
  compgen -G "$WHEELS/*.whl" > /dev/null || die "--wheels $WHEELS holds no .whl file"
  pyv=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  [ "$pyv" = 3.12 ] || echo "gpu_check.sh: warning: $PY is Python $pyv; the wheels are for 3.12" >&2
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  fi
fi

echo "== 1/2 install the wheels of $WHEELS into $SITE"
step rm -rf "$SITE"
step "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$WHEELS"/*.whl
export PYTHONPATH="$SITE"
echo "+ export PYTHONPATH=$SITE"

echo "== 2/2 the check (stopped after $LIMIT s) -> $REPORT"
if [ "$DRY" = 0 ]; then RUN_DIR=$(mktemp -d); else RUN_DIR="<a new temporary folder>"; fi
step cd "$RUN_DIR"
args=(--out "$REPORT" --wheels "$WHEELS")
[ -z "$STEPS" ] || args+=(--steps "$STEPS")
[ -z "$QUICK" ] || args+=("$QUICK")
export PYTHONUNBUFFERED=1
step timeout "$LIMIT" "$PY" -W ignore::DeprecationWarning -m varbatch_kit.cli.gpu_check "${args[@]}"
