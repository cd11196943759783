#!/usr/bin/env bash
# One GPU run: environment, the GPU tests, the decode and prefill benchmarks, and a short
# summary printed last (so that the end of the output, all a capped log may keep, says what
# happened).
#
# Run from the repository root, with the wheels in .whl/ (jax-triton 0.3.1 and fla-core, for a
# machine without network access) installed first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD; bash benchmarks/gpu_run.sh
#
# Files under $OUT (default ./bench_out): gpu_tests.log, bench.log (environment and benchmark
# output), decode.json, prefill.json, summary.txt. To publish results, copy a JSON file over
# the one in benchmarks/ and run `python3 benchmarks/make_results.py` (it rewrites RESULTS.md).
# Each JSON records date, commit, command and versions; where the tree has no .git, set
# GDP_COMMIT to name the commit.
# Wall-clock caps per step (seconds; keep their sum under the run's own wall-clock limit):
#   GDP_TEST_BUDGET (180), GDP_DECODE_BUDGET (180), GDP_PREFILL_BUDGET (150); GDP_TEST_WORKERS (6)
#   test processes when pytest-xdist is there.
# GDP_TEST_K: one pytest -k expression for the test step (spaces allowed).
# GDP_STEPS picks steps (default "tests,decode,prefill"; "stages" adds the per-stage prefill
# breakdown, "notebooks" runs tests/test_notebooks.py with Jupyter from .whl/nb, "beside" runs them
# alongside the tests instead of before); GDP_BENCH_ARGS is appended to both
# benchmark command lines (e.g. "--skip-fla", or "--cpu-smoke" to rehearse this script on a CPU
# machine), GDP_DECODE_ARGS / GDP_PREFILL_ARGS to one (e.g. GDP_STEPS=decode
# GDP_DECODE_ARGS="--parts copy,sweep" for a second call that only sweeps decode configs);
# GDP_SITE replaces /tmp/site.
# Each step runs even if an earlier one failed; no step can hang the call past its cap.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/bench_out}
mkdir -p "$OUT"
export OUT
LOG=$OUT/bench.log
: >"$LOG"
T_TESTS=${GDP_TEST_BUDGET:-180}
T_DECODE=${GDP_DECODE_BUDGET:-180}
T_PREFILL=${GDP_PREFILL_BUDGET:-150}
T0=$(date +%s)
stamp() { echo "[gpu_run +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

export PYTHONUNBUFFERED=1
export FLA_CACHE_RESULTS=0                # fla-core would otherwise cache autotune results on disk
export TRITON_CACHE_DIR=/tmp/triton_cache  # a real directory (importing jax_triton empties it)
mkdir -p "$TRITON_CACHE_DIR"

# 0. Make `import gdp_kernels` work: the package folder is kernels/ (pyproject maps the name),
#    so install the project (no network: setuptools is on the machine) into /tmp/site beside
#    the wheels. The repository root goes first on the path so that `python3 -m pytest` (which
#    puts the working directory first anyway) and the benchmark scripts import the same gdp_jax;
#    gdp_kernels exists only in /tmp/site. If the install fails, a symlink named gdp_kernels
#    to kernels/ does the same job.
SITE=${GDP_SITE:-/tmp/site}
BENCH_ARGS=${GDP_BENCH_ARGS:-}
STEPS=",${GDP_STEPS:-tests,decode,prefill},"
stamp "installing the project into $SITE"
# Built from a copy of the files the package needs, so the build leaves no build/ folder behind.
BUILD=$(mktemp -d /tmp/gdp_build.XXXXXX)
cp -r pyproject.toml README.md gdp_jax kernels "$BUILD"/
if ! python3 -m pip install -q --no-deps --no-build-isolation --no-index --no-compile \
    --no-cache-dir --upgrade --target "$SITE" "$BUILD" >>"$LOG" 2>&1; then
  stamp "pip install of the project failed (see above); using a gdp_kernels symlink instead"
  mkdir -p /tmp/gdp_alias && ln -sfn "$REPO/kernels" /tmp/gdp_alias/gdp_kernels
  SITE="$SITE:/tmp/gdp_alias"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"

# 1. Environment.
{
  echo "== environment"
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used,memory.total,temperature.gpu,power.draw --format=csv
  python3 - <<'EOF'
import importlib, sys
print("python", sys.version.split()[0])
for m in ("jax", "jaxlib", "triton", "torch", "jax_triton", "fla", "numpy", "gdp_jax", "gdp_kernels"):
  try:
    mod = importlib.import_module(m)
    print(f"{m:12s} {getattr(mod, '__version__', '')!s:10s} {getattr(mod, '__file__', '')}")
  except Exception as e:
    print(f"{m:12s} FAILED {type(e).__name__}: {e}")
import jax
print("jax devices:", jax.devices())
EOF
} 2>&1 | tee -a "$LOG"

# 2a. (GDP_STEPS=...,notebooks) The notebooks top to bottom on the GPU (their kernels run through
#     jax-triton there). For a GPU machine without Jupyter, `.whl/nb/` holds nbformat, nbclient,
#     ipykernel and their dependencies as py3.12 wheels, downloaded beforehand with
#       python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux_2_28_x86_64 -d .whl/nb nbformat nbclient ipykernel
#     They go into their own folder, last on the path, so they shadow nothing of jax or torch.
#     With GDP_STEPS=...,notebooks,beside,... they run in the background while the tests run (both
#     are mostly compilation on the CPU, which has 16 cores), and the benchmarks wait for both.
run_notebooks() {
  stamp "notebooks (cap ${GDP_NOTEBOOK_BUDGET:-420}s)"
  NB_SITE=/tmp/nbsite
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$NB_SITE" "$REPO"/.whl/nb/*.whl >>"$LOG" 2>&1 || stamp "installing .whl/nb failed"
  # One process per notebook test (pytest-xdist), so the cap bounds the slowest notebook, not
  # their sum; -rA prints each notebook's seconds per cell, passed or not. The cap's SIGINT
  # reaches the notebooks' kernels too: a capped run reads "KeyboardInterrupt" in a cell
  # (2026-11-30: the two notebooks together overran 290 s on the H200).
  NB_PAR=()
  python3 -c "import xdist" 2>/dev/null && NB_PAR=(-n 4)
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PYTHONPATH:$NB_SITE" \
    timeout -s INT -k 10 "${GDP_NOTEBOOK_BUDGET:-420}" \
    python3 -m pytest -q -rA ${NB_PAR[@]+"${NB_PAR[@]}"} tests/test_notebooks.py \
    >"$OUT/notebooks.log" 2>&1
  rc=$?
  grep -a "seconds per code cell" "$OUT/notebooks.log"
  tail -n 40 "$OUT/notebooks.log"
  stamp "notebook tests exit $rc"
}
NB_PID=
if [[ $STEPS == *,notebooks,* ]]; then
  if [[ $STEPS == *,beside,* ]]; then run_notebooks & NB_PID=$!; else run_notebooks; fi
fi

# 2. The GPU tests, all of them (no -x; -v names each, so a capped run says which ran), each
#    capped by pytest-timeout, the whole step by `timeout` (SIGINT first, so pytest still prints
#    its summary of what ran).
if [[ $STEPS == *,tests,* ]]; then
  stamp "pytest -m gpu (cap ${T_TESTS}s)"
  PER_TEST=()
  python3 -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 300)
  # Most of the step is Triton compiling each kernel variant on the CPU: spread the tests over
  # GDP_TEST_WORKERS processes (pytest-xdist), which share the GPU, so none may preallocate it.
  WORKERS=${GDP_TEST_WORKERS:-6}
  python3 -c "import xdist" 2>/dev/null && [ "$WORKERS" -gt 1 ] && PER_TEST+=(-n "$WORKERS")
  # GDP_TEST_ARGS: extra pytest arguments, split at spaces; GDP_TEST_K: one -k expression, kept
  # whole (e.g. "prefill or launch"; "||" is not pytest syntax). (A comment inside the
  # command's continued lines once cut the environment setting off it: every worker then
  # preallocated 75% of the GPU, and the tests failed out of memory.)
  K_EXPR=()
  [ -n "${GDP_TEST_K:-}" ] && K_EXPR=(-k "$GDP_TEST_K")
  # The platform allocator hands memory back as arrays die: with XLA's pooling allocator each
  # worker kept its high-water mark, and 8 workers ran the GPU out of memory (2026-12-03).
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
  timeout -s INT -k 10 "$T_TESTS" python3 -m pytest -m gpu -v -ra ${PER_TEST[@]+"${PER_TEST[@]}"} \
    ${K_EXPR[@]+"${K_EXPR[@]}"} ${GDP_TEST_ARGS:-} tests/ \
    >"$OUT/gpu_tests.log" 2>&1
  rc=$?
  msg="pytest exit $rc$([ $rc -eq 124 ] && echo ' (TIMED OUT: the counts below cover what ran)')"
  echo "[gpu_run] $msg" >>"$OUT/gpu_tests.log"  # the summary reads it from there
  tail -n 60 "$OUT/gpu_tests.log"
  stamp "$msg"
fi
[ -n "$NB_PID" ] && wait "$NB_PID"

# 3. + 4. Benchmarks. The scripts stop starting rows a margin before their cap (--budget-s) and
#    write their JSON after every row, so a capped run still returns what it measured.
#    bench SCRIPT CAP MARGIN EXTRA_ARGS
bench() {
  stamp "benchmarks/$1 (cap $2s)"
  timeout -s INT -k 10 "$2" python3 "benchmarks/$1" --budget-s $(($2 - $3)) \
    $BENCH_ARGS $4 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  stamp "$1 exit $rc$([ $rc -eq 124 ] && echo ' (TIMED OUT)')"
}
[[ $STEPS == *,decode,* ]] && bench decode.py "$T_DECODE" 30 "${GDP_DECODE_ARGS:-}"
[[ $STEPS == *,prefill,* ]] && bench prefill.py "$T_PREFILL" 45 "${GDP_PREFILL_ARGS:-}"
# Optional (GDP_STEPS=...,stages): prefill time per stage, and with GDP_STAGES_ARGS=--sweep the
# block sizes and warps of each big stage; cap GDP_STAGES_BUDGET (240).
[[ $STEPS == *,stages,* ]] && bench prefill_stages.py "${GDP_STAGES_BUDGET:-240}" 30 \
  "${GDP_STAGES_ARGS:-}"

# 5. Summary, last.
python3 benchmarks/common.py --summary "$OUT" 2>&1 | tee "$OUT/summary.txt"
stamp "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
