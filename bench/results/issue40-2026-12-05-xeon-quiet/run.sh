#!/bin/bash
# Quiet-machine run of issue 40's figures on merged main (one process at a time).
cd /work/main
R=bench/results/issue40-2026-12-05-xeon-quiet
M=~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf
B=~/.cache/tandem/llama.cpp/build/bin
export OMP_WAIT_POLICY=passive
la() { echo "load: $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T) $*" | tee -a $R/load.txt; }
la start
la peak; build/bench/tandem-bench-engine -m $M -t 2 --peak --kernels amx,avx512,avx2 --rounds 2 --json $R/peak.json > $R/peak.txt 2>&1; la peak-done
la kv; build/bench/tandem-bench-kv-transfer --seconds 2 --rounds 5 --json $R/kv.json > $R/kv.txt 2>&1; la kv-done
la tandem8k-1; build/bench/tandem-bench-engine -m $M -t 2 --depth 8192 --steps 16 --json $R/tandem8k-1.json > $R/tandem8k-1.txt 2>&1
la llama-pp8192-fa1; $B/llama-bench -m $M -t 2 -p 8192 -n 0 -fa 1 --repack 0 -r 1 > $R/llama-pp8192-fa1.txt 2>&1
la llama-tg16-d8192-fa0; $B/llama-bench -m $M -t 2 -p 0 -n 16 -d 8192 -fa 0 --repack 0 -r 1 > $R/llama-tg16-d8192-fa0.txt 2>&1
la llama-bb8-d8192-fa0; $B/llama-batched-bench -m $M -t 2 -c $((8*(8192+16)+64)) -b 2048 -ub 512 -npp 8192 -ntg 16 -npl 8 -pps -fa off --no-repack > $R/llama-bb8-d8192-fa0.txt 2>&1
la tandem8k-2; build/bench/tandem-bench-engine -m $M -t 2 --depth 8192 --steps 16 --json $R/tandem8k-2.json > $R/tandem8k-2.txt 2>&1
la done
#!/bin/bash
cd /work/main
R=bench/results/issue40-2026-12-05-xeon-quiet
M=~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf
B=~/.cache/tandem/llama.cpp/build/bin
export OMP_WAIT_POLICY=passive
la() { echo "load: $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T) $*" | tee -a $R/load.txt; }
la tandem8k-shared; build/bench/tandem-bench-engine -m $M -t 2 --depth 8192 --steps 16 --json $R/tandem8k-3.json > $R/tandem8k-3.txt 2>&1
la llama-pp8192-fa0; $B/llama-bench -m $M -t 2 -p 8192 -n 0 -fa 0 --repack 0 -r 1 > $R/llama-pp8192-fa0.txt 2>&1
la llama-tg16-d8192-fa1; $B/llama-bench -m $M -t 2 -p 0 -n 16 -d 8192 -fa 1 --repack 0 -r 1 > $R/llama-tg16-d8192-fa1.txt 2>&1
la llama-bb8-d8192-fa1; $B/llama-batched-bench -m $M -t 2 -c $((8*(8192+16)+64)) -b 2048 -ub 512 -npp 8192 -ntg 16 -npl 8 -pps -fa on --no-repack > $R/llama-bb8-d8192-fa1.txt 2>&1
la longctx2048; python3 bench/longctx.py --threads 2 --depth 2048 --rounds 1 --json $R/longctx2048.json > $R/longctx2048.txt 2>&1
la done2
# second round at 8,192 (alternated): llama.cpp's best settings, Tandem between
cd /work/main
R=bench/results/issue40-2026-12-05-xeon-quiet
M=~/.cache/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf
B=~/.cache/tandem/llama.cpp/build/bin
export OMP_WAIT_POLICY=passive
la() { echo "load: $(cut -d' ' -f1-3 /proc/loadavg) $(date +%T) $*" | tee -a $R/load.txt; }
la r2-llama-tg16-d8192-fa0; $B/llama-bench -m $M -t 2 -p 0 -n 16 -d 8192 -fa 0 --repack 0 -r 1 > $R/r2-llama-tg16-d8192-fa0.txt 2>&1
la r2-tandem8k; build/bench/tandem-bench-engine -m $M -t 2 --depth 8192 --steps 16 --json $R/r2-tandem8k.json > $R/r2-tandem8k.txt 2>&1
la r2-llama-pp8192-fa1; $B/llama-bench -m $M -t 2 -p 8192 -n 0 -fa 1 --repack 0 -r 1 > $R/r2-llama-pp8192-fa1.txt 2>&1
la r2-llama-bb8-d8192-fa0; $B/llama-batched-bench -m $M -t 2 -c $((8*(8192+16)+64)) -b 2048 -ub 512 -npp 8192 -ntg 16 -npl 8 -pps -fa off --no-repack > $R/r2-llama-bb8-d8192-fa0.txt 2>&1
la done3
