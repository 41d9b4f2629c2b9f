#!/usr/bin/env bash
# Everything a device run of bench/gpu_checks.sh needs, made on a CPU machine: the kernel
# cache warmed for sm_90 with every kernel the steps launch, the Hugging Face configs of
# bench/patch_models.py, and Liger's wheel, packed into .carry/ (a device run carries at most
# 64 MiB). On 2 cores, 2026-12-07 (3f1eacd): 4516 kernels, 5 min 18 s in all, .carry 58 MB
# (of it the interpreter's results, cpu.pt.xz, 40 MB: little room is left). Commit first:
# the cache is keyed by the kernels' source, so the device must run the same commit.
#   bash bench/gpu_prepare.sh
#   run(command="bash bench/gpu_checks.sh gpu_tests rows", carry=[".carry"])
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .kbuild-aot .carry
mkdir -p .carry
# Each module's warmup_specs() lists what its step launches (bench_rows.py: its norms too).
modules=(examples/custom_softmax.py bench/math_accuracy.py bench/bench_rows.py
         bench/bench_loss.py bench/bench_block.py bench/bench_ce_clusters.py
         bench/interpret_vs_gpu.py kbuild.kernels.loss.cross_entropy kbuild.kernels.softmax.op
         kbuild.kernels.rope.op kbuild.kernels.activations.op kbuild.kernels.rope.qk_norm)
args=()
for m in "${modules[@]}"; do args+=(--module "$m"); done
python3 -m kbuild warmup --arch sm_90 --manifest tests --manifest bench --manifest tune "${args[@]}" --cache-dir .kbuild-aot
if [ -f bench/patch_models.py ]; then
    python3 bench/patch_models.py --write-configs .carry/configs
    for c in .carry/configs/*.json; do
        python3 -m kbuild warmup --arch sm_90 --model "$c" --cache-dir .kbuild-aot
    done
fi
# The interpreter's results on the inputs interpret_vs_gpu.py's step compares the GPU's with
KBUILD_INTERPRET=1 PYTHONPATH=. python3 bench/interpret_vs_gpu.py run cpu .carry/cpu.pt && xz -T2 .carry/cpu.pt
pip download -q --no-deps liger-kernel==0.8.5 -d .carry || echo "no Liger wheel: its peers will be recorded as unavailable"
tar -cf - .kbuild-aot | xz -T2 >.carry/aot.tar.xz
du -sh .carry
