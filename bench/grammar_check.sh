#!/bin/sh
# grammar_check.sh - the CI correctness check of structured output on a fixed sample of
# MaskBench: every 10th file of shared/testdata/maskbench-dev sorted by name (524 of 5,237),
# the default model's tokenizer. Fails on any invalid instance accepted, or when fewer than
# MIN_PASS of the compiled schemas judge all their instances right. Skips (77) with the reason
# when the data or the model is missing.
# Usage: sh grammar_check.sh BENCH_BINARY SOURCE_DIR SHARED_DIR WORK_DIR
set -eu
bench=$1 src=$2 shared=$3 work=$4
# Measured at this commit: 491 of the 524 schemas compile and 490 of them judge every instance
# right; the one that does not (Glaiveai2K---calculate_area_245ee1e7.json) has a valid instance
# listing its properties out of definition order, which the grammar does not allow by design
# (docs/structured-output.md). 0.99 leaves room for one more such file, no more.
MIN_PASS=0.99
data=$shared/testdata/maskbench-dev
if [ ! -d "$data" ]; then
    echo "skip: $data is missing (the shared test data)"
    exit 77
fi
python3 "$src/bench/grammar_setup.py" "$data" "$work/grammar-cache"
exec "$bench" --dir "$data" --cache "$work/grammar-cache" --every 10 --check \
    --min-pass "$MIN_PASS" --json "$work/grammar-sample.json"
