#!/usr/bin/env bash
# The GPU measurements the CPU machine cannot make, in one device run (about 20 minutes of
# the H200). Prepare here (CPU; about 3 minutes on 2 cores):
#   rm -rf .kbuild-aot .kbuild-before
#   kbuild warmup --arch sm_90 --manifest tests --manifest bench \
#       --module examples/custom_softmax.py --module bench/math_accuracy.py --cache-dir .kbuild-aot
#   mkdir .kbuild-before && git archive <commit before the change> | tar -x -C .kbuild-before
# then run on the device, carrying .kbuild-aot and .kbuild-before, one device call per step
# or two (a call may last 10 minutes; host_versions alone takes about that):
#   bash bench/gpu_checks.sh gpu_tests custom_softmax math_accuracy
#   bash bench/gpu_checks.sh host_versions
# Results under $OUT (or ./gpu-results). Each step writes its own file and log; a failing
# step does not stop the next. With no step named, all four run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export KBUILD_CACHE_DIR="$PWD/.kbuild-aot" KBUILD_OFFLINE=1 PYTHONPATH="$PWD"
export KBUILD_NATIVE_DIR="$PWD/.kbuild-native"
step() {  # name, command...: the command's output in $out/name.log, its status in the summary
    local name=$1
    shift
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv >"$out/gpu.txt"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gpu_tests custom_softmax math_accuracy host_versions)
for name in "${steps[@]}"; do
    case "$name" in
        gpu_tests) step gpu_tests python3 -m pytest -m gpu tests -q -p no:cacheprovider ;;
        custom_softmax) step custom_softmax python3 bench/bench_custom_softmax.py "$out/custom_softmax.json" ;;
        math_accuracy) step math_accuracy python3 bench/math_accuracy.py "$out/math_accuracy.json" ;;
        host_versions) step host_versions python3 bench/host_versions.py .kbuild-before . "$out" ;;
        host) step host python3 bench/host.py "$out" ;;
        *) echo "gpu_checks.sh: unknown step $name" >&2; exit 2 ;;
    esac
done
tail -n 3 "$out"/*.log >"$out/tails.txt"
