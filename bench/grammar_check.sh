#!/bin/sh
# grammar_check.sh - the CI correctness check of structured output on a fixed sample of
# MaskBench: every 10th file of shared/testdata/maskbench-dev sorted by name (524 of 5,237),
# the default model's tokenizer. Fails on any invalid instance accepted, or when fewer than
# MIN_PASS of the compiled schemas judge all their instances right. Skips (77) with the reason
# when the data or the model is missing.
# Usage: sh grammar_check.sh BENCH_BINARY SOURCE_DIR SHARED_DIR WORK_DIR
set -eu
bench=$1 src=$2 shared=$3 work=$4
# Measured at this commit: 517 of the 524 schemas compile and all 517 judge every instance
# right (a miss of a valid instance that lists properties out of definition order, possible in
# objects of five or more properties, would count as passing: docs/structured-output.md,
# property order), so the floor is 1.0: the list of known exceptions is empty.
MIN_PASS=1.0
data=$shared/testdata/maskbench-dev
if [ ! -d "$data" ]; then
    echo "skip: $data is missing (the shared test data)"
    exit 77
fi
python3 "$src/bench/grammar_setup.py" "$data" "$work/grammar-cache"
exec "$bench" --dir "$data" --cache "$work/grammar-cache" --every 10 --check \
    --min-pass "$MIN_PASS" --json "$work/grammar-sample.json"
