#!/usr/bin/env bash
# bench/llama-cpp.sh - builds llama.cpp's llama-bench, llama-batched-bench and llama-server (the
# benchmarks' peer) from the sources vendored in the llama-cpp-python sdist, into a cache outside
# the work tree, and prints where the binaries are.
#
# The sdist is downloaded with pip (`pip download --no-binary :all: --no-deps`) into
# $CACHE/sdist unless it is already there, extracted into $CACHE/llama.cpp-src, configured
# without curl/OpenSSL for this machine's ISA (GGML_NATIVE) and built with -j$JOBS; about 25
# minutes on 2 cores. Idempotent: when the three binaries exist it only prints their paths.
# Never part of the test run.
#
# ISA=avx2 builds a second tree, $CACHE/llama.cpp-avx2/build, for the AVX2 rows of an AVX-512
# machine (issue 40): GGML_NATIVE off, AVX/AVX2/FMA/F16C/BMI2 on, AVX-512, AVX-VNNI and AMX off
# (ggml's CPU backend then picks exactly the AVX2 kernels Tandem's TANDEM_CPU_KERNELS=avx2 is
# compared with); llama-bench and llama-batched-bench only.
#
# usage: bench/llama-cpp.sh [--print]   (--print: only print the bin dir, fail if not built)
#        env LLAMA_CPP_PYTHON=llama-cpp-python==0.3.36, JOBS=2, ISA=native|avx2,
#        CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/tandem
set -euo pipefail

spec=${LLAMA_CPP_PYTHON:-llama-cpp-python==0.3.36}
jobs=${JOBS:-2}
cache=${CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem}
src=$cache/llama.cpp-src
case "${ISA:-native}" in
native)
    build=$cache/llama.cpp/build
    targets=(llama-bench llama-batched-bench llama-server)
    isa_flags=(-DGGML_NATIVE=ON)
    ;;
avx2)
    build=$cache/llama.cpp-avx2/build
    targets=(llama-bench llama-batched-bench)
    isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF
        -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
        -DGGML_AMX_BF16=OFF)
    ;;
*)
    echo "llama-cpp: error: ISA must be native or avx2, not '$ISA'" >&2
    exit 1
    ;;
esac
bin=$build/bin

die() {
    echo "llama-cpp: error: $*" >&2
    exit 1
}

built() {
    local t
    for t in "${targets[@]}"; do
        [ -x "$bin/$t" ] || return 1
    done
}

if [ "${1:-}" = --print ]; then
    built || die "not built; run bench/llama-cpp.sh"
    echo "$bin"
    exit 0
fi

if built; then
    echo "llama-cpp: built in $bin: ${targets[*]}"
    exit 0
fi

# fetch_sdist: the sdist in $cache/sdist (downloaded once), printed.
fetch_sdist() {
    local dir=$cache/sdist name=${spec%%==*} f
    mkdir -p "$dir"
    f=$(find "$dir" -maxdepth 1 -name "${name//-/_}-${spec##*==}.tar.gz" | head -n 1)
    if [ -z "$f" ]; then
        echo "llama-cpp: downloading the $spec sdist from PyPI (about 77 MB)" >&2
        python3 -m pip download --quiet --no-deps --no-binary=:all: \
            --disable-pip-version-check -d "$dir" "$spec" >&2 ||
            die "pip download $spec failed (is PyPI reachable?)"
        f=$(find "$dir" -maxdepth 1 -name '*.tar.gz' | head -n 1)
        [ -n "$f" ] || die "pip download gave no sdist in $dir"
    fi
    echo "$f"
}

if [ ! -f "$src/vendor/llama.cpp/CMakeLists.txt" ]; then
    sdist=$(fetch_sdist)
    echo "llama-cpp: extracting $sdist into $src"
    rm -rf "$src.part"
    mkdir -p "$src.part"
    tar -xzf "$sdist" -C "$src.part" --strip-components=1 || die "cannot extract $sdist"
    [ -f "$src.part/vendor/llama.cpp/CMakeLists.txt" ] || die "$sdist has no vendor/llama.cpp"
    rm -rf "$src"
    mv "$src.part" "$src"
fi

if [ ! -f "$build/CMakeCache.txt" ]; then
    cmake -S "$src/vendor/llama.cpp" -B "$build" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DCMAKE_BUILD_TYPE=Release "${isa_flags[@]}" -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null || die "cmake configure failed"
fi
cmake --build "$build" -j"$jobs" --target "${targets[@]}" || die "build failed"
built || die "build finished without ${targets[*]} in $bin"
echo "llama-cpp: built in $bin: ${targets[*]}"
