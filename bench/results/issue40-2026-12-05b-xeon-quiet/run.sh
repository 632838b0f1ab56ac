#!/bin/bash
# Quiet-machine run (nothing else running) of issue 40's remaining figures, 2026-12-05 evening:
# 16k/32k on a Llama-3.2-1B-shaped synth file, AVX2 rows against an AVX2-only llama.cpp build,
# and A/Bs of this stop's kernel changes against the build before them (/work/base-bin).
set -u
cd /work/main
R=bench/results/issue40-2026-12-05b-xeon-quiet
M=~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf
G=~/.cache/tandem/models/gemma-3-270m-q4_k_m.gguf
S=~/.cache/tandem/models/synth-llama-3.2-1b-L2-Q4_0.gguf
K=~/.cache/tandem/models/synth-llama-3.2-1b-L2-Q4_K.gguf
B=~/.cache/tandem/llama.cpp/build/bin
B2=~/.cache/tandem/llama.cpp-avx2/build/bin
E=build/bench/tandem-bench-engine
E0=/work/base-bin/tandem-bench-engine
export OMP_WAIT_POLICY=passive
la() { echo "load: $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T) $*" | tee -a $R/load.txt; }
part=${1:-all}
if [ "$part" = all ] || [ "$part" = longctx ]; then
    la longctx-1b
    python3 bench/longctx.py --model $S --depth 16384,32768 --steps 16 --rounds 1 --pp-fa 1 \
        --tg-fa 0 --llama-bin $B --json $R/longctx-1b.json > $R/longctx-1b.txt 2>&1
    la longctx-1b-done
fi
if [ "$part" = all ] || [ "$part" = avx2 ]; then
    for round in 1; do
        la avx2-tandem-$round
        TANDEM_CPU_KERNELS=avx2 $E -m $M -t 2 --json $R/avx2-tandem-$round.json > $R/avx2-tandem-$round.txt 2>&1
        la avx2-llama-bench-$round
        $B2/llama-bench -m $M -t 2 -p 128,512 -n 32 -fa 0,1 --repack 0 -r 1 -o json > $R/avx2-llama-bench-$round.json 2> $R/avx2-llama-bench-$round.err
        la avx2-llama-batched-$round
        $B2/llama-batched-bench -m $M -t 2 -c 8192 -b 2048 -ub 512 -npp 128 -ntg 32 -npl 1,8,32 -fa off --no-repack --output-format jsonl > $R/avx2-llama-batched-$round.jsonl 2> $R/avx2-llama-batched-$round.err
    done
    la avx2-done
fi
if [ "$part" = all ] || [ "$part" = ab ]; then
    for round in 1 2; do
        for side in base new; do
            bin=$E; [ $side = base ] && bin=$E0
            la ab-kq-$side-$round
            $bin -m $K -t 2 --peak --kernels avx512 --rounds 1 --json $R/ab-kq-synth-$side-$round.json > $R/ab-kq-synth-$side-$round.txt 2>&1
            $bin -m $G -t 2 --peak --kernels avx512 --rounds 1 --json $R/ab-kq-gemma-$side-$round.json > $R/ab-kq-gemma-$side-$round.txt 2>&1
            la ab-q8-$side-$round
            $bin -m $M -t 2 --depth 2048 --steps 16 --kv q8 --json $R/ab-q8-$side-$round.json > $R/ab-q8-$side-$round.txt 2>&1
        done
    done
    la ab-done
fi
# round 2 of the AVX2 rows (run by hand after the script): llama.cpp first, then Tandem with
# passive and active OpenMP waiting
#   $B2/llama-bench -m $M -t 2 -p 128,512 -n 32 -fa 0,1 --repack 0 -r 1 -o json > $R/avx2-llama-bench-2.json
#   OMP_WAIT_POLICY=passive TANDEM_CPU_KERNELS=avx2 $E -m $M -t 2 --json $R/avx2-tandem-2.json
#   OMP_WAIT_POLICY=active TANDEM_CPU_KERNELS=avx2 $E -m $M -t 2 --json $R/avx2-tandem-2-active.json
#   $B2/llama-batched-bench -m $M -t 2 -c 8192 -b 2048 -ub 512 -npp 128 -ntg 32 -npl 1,8,32 -fa off --no-repack --output-format jsonl > $R/avx2-llama-batched-2.jsonl
#   OMP_WAIT_POLICY=active TANDEM_CPU_KERNELS=avx2 $E -m $M -t 2 --json $R/avx2-tandem-3-active.json
#   $B2/llama-bench -m $M -t 2 -p 0 -n 32 -fa 0,1 --repack 0 -r 3 -o json > $R/avx2-llama-tg-3.json
