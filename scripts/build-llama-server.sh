#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer `make bench` compares relaylm with, llama-perplexity,
# the reference `make bench-perplexity` compares relaylm's perplexity with, and llama-quantize,
# which `make bench-moe` uses to make its Q4_K_M GGUF, from the llama.cpp sources that the
# llama-cpp-python sdist on PyPI ships (no other network access is needed).
#   scripts/build-llama-server.sh PYTHON [VERSION]
#     → .cache/llama.cpp/bin/llama-server, .cache/llama.cpp/bin/llama-perplexity,
#       .cache/llama.cpp/bin/llama-quantize
# CPU build for this machine (GGML_NATIVE); no web UI and no HTTPS, so the build fetches nothing;
# ~4-6 min on 2 cores. Builds only the binaries that are missing (the copies link the shared
# libraries in .cache/llama.cpp/build/bin, so keep that folder).
set -euo pipefail
python=${1:?usage: build-llama-server.sh PYTHON [llama-cpp-python version]}
version=${2:-0.3.36}
root="$(cd "$(dirname "$0")/.." && pwd)/.cache/llama.cpp"
missing=()
for tool in llama-server llama-perplexity llama-quantize; do
    if [ -x "$root/bin/$tool" ]; then
        echo "$tool already built: $root/bin/$tool"
    else
        missing+=("$tool")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
mkdir -p "$root/src" "$root/bin"
sources="$root/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$sources/CMakeLists.txt" ]; then
    "$python" -m pip download -q --no-deps --no-binary :all: -d "$root/src" "llama-cpp-python==$version"
    tar -xzf "$root/src/llama_cpp_python-$version.tar.gz" -C "$root/src"
fi
# LLAMA_BUILD_TOOLS (on by default for a top-level build) is what adds tools/perplexity, tools/quantize
# and tools/server.
cmake -S "$sources" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$root/build" --target "${missing[@]}" -j "$(nproc)"
for tool in "${missing[@]}"; do
    cp "$root/build/bin/$tool" "$root/bin/$tool"
    echo "built $root/bin/$tool"
done
