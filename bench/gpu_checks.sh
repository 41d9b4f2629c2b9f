#!/usr/bin/env bash
# The GPU measurements the CPU machine cannot make, in one device run (about 20 minutes of
# the H200). Prepare here with `bash bench/gpu_prepare.sh` (CPU; about 4 minutes on 2 cores:
# the warmed cache and Liger's wheel packed into .carry/), carry [".carry"], and run on the
# device one or two steps per call (a call may last 10 minutes; host_versions alone takes
# about that, and wants `.kbuild-before`, a `git archive` of the commit before a change):
#   bash bench/gpu_checks.sh gpu_tests rows
#   bash bench/gpu_checks.sh math_accuracy host
#   bash bench/gpu_checks.sh models profile
#   bash bench/gpu_checks.sh loss block
#     (LOSS_ARGS: bench_loss.py's options, e.g. '--parts fused --chunks 512,1024,2048,4096')
#   bash bench/gpu_checks.sh interpret ce_clusters
#     (CE_CLUSTERS_ARGS: e.g. '--rows 1024 --vocabs 128256,151936', a fused loss chunk's rows)
#     (interpret: the interpreter's values, carried, against the GPU's: interpret.log)
#   bash bench/gpu_checks.sh tune
#     (TUNE_ARGS: bench/tune.py's kernel:N, e.g. 'rmsnorm_bwd:4097 layernorm_bwd:5123')
#   bash bench/gpu_checks.sh patch_models
#     (split over calls by PATCH_MODELS_ARGS, e.g. '--modes eager'; the results merge)
#   bash bench/gpu_checks.sh host_versions
# Owed as of 2026-12-08, after b56e459 (bench/NOTES.md says what each showed last, and what
# 686502c to b56e459 changed unmeasured): loss with LOSS_ARGS='--parts fused --heads gpt2
# --skip torch.compile' (GPT-2's head on padded logits rows, beside the unpadded layout);
# patch_models compile for the five models not run at 430f1fd (PATCH_MODELS_ARGS='--modes
# compile --variants stock,kbuild --no-longest --models ...', two or three a call; qwen3 ran
# 0.96x stock there), eager for all six, three rounds (the fused loss chunks' cross-entropy
# plan changed at 18d9f93, GPT-2's head at a62b6b8); rows (softmax at 50257 held by cluster
# 8, 288be67); ce_clusters at 8192 rows (the reversed second pass) and with
# CE_CLUSTERS_ARGS='--rows 1024 --vocabs 128256,151936,256000' (the fused loss's chunks); tune
# with TUNE_ARGS='rmsnorm_bwd:4097 rmsnorm_bwd:5123 layernorm_bwd:4097 layernorm_bwd:5120
# layernorm_bwd:5123'; loss (cross-entropy at the floor, and whether V = 32000 / 50257 are
# still host-bound after Op.run, 14b95a9, and the persistent rescale, bb65b18: the cases'
# device_ms beside their event time); block (the streamed activation forwards); host;
# interpret; gpu_tests; every step on an H200 too.
# Results under $OUT (or ./gpu-results). Each step writes its own file and log; a failing
# step does not stop the next. With no step named, all four run.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out/launched"
export KBUILD_CACHE_DIR="$PWD/.kbuild-aot" KBUILD_OFFLINE=1 PYTHONPATH="$PWD"
export KBUILD_NATIVE_DIR="$PWD/.kbuild-native"
step() {  # name, command...: the command's output in $out/name.log, its status in the summary,
    # and every kernel spec it asked for in $out/launched/name.jsonl (KBUILD_RECORD; the CPU
    # test tests/test_launched_cpu.py holds the warm lists to these records)
    local name=$1
    shift
    local start=$SECONDS
    KBUILD_RECORD="$out/launched/$name.jsonl" "$@" >"$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/summary.txt"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv >"$out/gpu.txt"
# The carried cache, unpacked once (Python's tarfile: the device may lack xz)
[ -d .kbuild-aot ] || [ ! -f .carry/aot.tar.xz ] ||
    python3 -c "import tarfile; tarfile.open('.carry/aot.tar.xz').extractall('.')"
# Liger-Kernel (pure Python), the peer of the loss and block steps, where its wheel was carried
ls .carry/liger_kernel-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .carry/liger_kernel-*.whl
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(gpu_tests rows math_accuracy host_versions)
for name in "${steps[@]}"; do
    case "$name" in
        gpu_tests) step gpu_tests python3 -m pytest -m gpu tests -q -p no:cacheprovider ;;
        math_accuracy) step math_accuracy python3 bench/math_accuracy.py "$out/math_accuracy.json" ;;
        host_versions) step host_versions python3 bench/host_versions.py .kbuild-before . "$out" ;;
        host) step host python3 bench/host.py "$out" ;;
        rows) step rows python3 bench/bench_rows.py "$out/rows.json" ;;
        block) step block python3 bench/bench_block.py "$out/block.json" ;;
        models) step models python3 bench/models.py "$out" --models gpt2-d1024-l6,gpt2-d768-l4,gpt2-124m --modes eager ;;
        profile) step profile python3 bench/model_profile.py "$out" --model gpt2-d1024-l6 ;;
        loss) step loss python3 bench/bench_loss.py "$out/loss.json" ${LOSS_ARGS:-} ;;
        tune) step tune python3 bench/tune.py "$out/tune.json" ${TUNE_ARGS:-} ;;
        ce_clusters) step ce_clusters python3 bench/bench_ce_clusters.py "$out/ce_clusters.json" ${CE_CLUSTERS_ARGS:-} ;;
        interpret) python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('.carry/cpu.pt.xz'), open('.carry/cpu.pt', 'wb'))"
                   step interpret_run python3 bench/interpret_vs_gpu.py run cuda "$out/gpu.pt"
                   step interpret python3 bench/interpret_vs_gpu.py compare "$out/gpu.pt" .carry/cpu.pt
                   rm -f "$out/gpu.pt" ;;
        patch_models) step patch_models python3 bench/patch_models.py "$out" ${PATCH_MODELS_ARGS:-} ;;
        *) echo "gpu_checks.sh: unknown step $name" >&2; exit 2 ;;
    esac
done
tail -n 3 "$out"/*.log >"$out/tails.txt"
