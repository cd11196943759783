#!/usr/bin/env bash
# Hardware counters of chosen kernels (Nsight Compute), run after benchmarks/gpu_run.sh has
# installed the project (gdp_kernels) into the path.
#
#   bash benchmarks/ncu_run.sh NAME REGEX SKIP COUNT CMD...
#
# profiles COUNT launches of the kernels whose names match REGEX, after skipping SKIP of them
# (compile and warm-up runs), while CMD runs; the report goes to $OUT/ncu_NAME.txt. The clocks
# are left alone (--clock-control none): the kernels run at the clocks they get without the
# profiler, and the GPU's settings are not touched. Sections: throughput against
# the peaks, occupancy and its limiters, launch sizes, warp stall reasons, scheduler issue
# rates, memory traffic per level.
set -u
NAME=$1; REGEX=$2; SKIP=$3; COUNT=$4; shift 4
OUT=${OUT:-./bench_out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then echo "[ncu_run] no ncu on this machine" | tee "$OUT/ncu_$NAME.txt"; exit 1; fi
timeout -s INT "${GDP_NCU_BUDGET:-150}" "$NCU" --clock-control none --target-processes all \
  -k "regex:$REGEX" --launch-skip "$SKIP" --launch-count "$COUNT" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  "$@" >"$OUT/ncu_$NAME.txt" 2>&1
rc=$?
echo "[ncu_run] $NAME rc=$rc; $(grep -c '^  [a-z_]*kernel' "$OUT/ncu_$NAME.txt") kernel reports" \
  | tee -a "$OUT/ncu_$NAME.txt"
exit $rc
