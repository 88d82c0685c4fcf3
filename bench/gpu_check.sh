#!/usr/bin/env bash
# The GPU check in one command, for an offline CUDA machine (bench/gpu_check.py has the steps).
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [--wheels DIR] [--steps a,b] [--budget S]
#
# 1. installs megarl with no network: the wheels megarl needs beside the machine's own torch,
#    Triton and transformers (`make gpu-wheels` fills gpu-wheels/, for Python 3.12 by default),
#    then megarl itself, into DIR/site with pip --no-index --no-deps;
# 2. runs every step under its own timeout, writing DIR/STEP.json and DIR/STEP.log, and
#    DIR/summary.json; exit status 0 when every step passed. MEGARL_GPU_CHECK_PYTEST="a b;c"
#    replaces the pytest step's test files (runs separated by ;);
# 3. packs summary.json and every STEP.json / STEP.log into ONE small archive, DIR/results.tgz
#    (never the model or DIR/site), and prints its path: copy that file back (cp DIR/results.tgz
#    $OUT/ on a machine that returns only a few files).
# --budget S: seconds for all steps (default 510); the steps that already passed on a GPU run
# last and are the ones a short budget leaves unrun.
# --dry-run: the same on the CPU with tiny shapes (in `make test`, so the check cannot rot).
# PYTHON (default python3) is the interpreter to install into and run.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0 OUT=gpu_check_out WHEELS=gpu-wheels STEPS="" BUDGET=510
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --out) OUT=$2; shift 2 ;;
        --wheels) WHEELS=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --budget) BUDGET=$2; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
    esac
done
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE=$OUT/site

if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "gpu_check.sh: no wheels in '$WHEELS': run 'make gpu-wheels' on a machine with" \
         "network access and bring the folder along (or pass --wheels DIR)" >&2
    exit 2
fi
echo "[gpu_check] install: $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS and megarl into $SITE"
t0=$(date +%s)
rm -rf "$SITE"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    "$WHEELS"/*.whl
# A real (non-editable) install: megarl's embedded:// locations resolve through its entry points.
had_build=0; [ -e build ] && had_build=1
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
    --target "$SITE" . >"$OUT/install_megarl.log" 2>&1 || { cat "$OUT/install_megarl.log"; exit 1; }
[ "$had_build" = 1 ] || rm -rf build
echo "[gpu_check] install: $(( $(date +%s) - t0 )) s"

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
    export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""
    ARGS=(--dry-run)
else
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TRITON_INTERPRET=0
    ARGS=()
fi
[ -n "$STEPS" ] && ARGS+=(--steps "$STEPS")
rc=0
rm -f "$OUT/results.tgz"
"$PYTHON" bench/gpu_check.py run --out "$OUT" --budget "$BUDGET" "${ARGS[@]}" || rc=$?
if [ ! -s "$OUT/results.tgz" ]; then  # the driver died before packing: pack what is there
    (cd "$OUT" && tar -czf results.tgz $(ls ./*.json ./*.log 2>/dev/null)) || true
    echo "[gpu_check] results: $OUT/results.tgz (packed by gpu_check.sh; bring it back with:" \
         "cp $OUT/results.tgz \$OUT/)"
fi
exit "$rc"
