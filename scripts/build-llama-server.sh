#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer `make bench` compares relaylm with, from the llama.cpp
# sources that the llama-cpp-python sdist on PyPI ships (no other network access is needed).
#   scripts/build-llama-server.sh PYTHON [VERSION]   → .cache/llama.cpp/bin/llama-server
# CPU build for this machine (GGML_NATIVE); no web UI and no HTTPS, so the build fetches nothing;
# ~4 min on 2 cores.
set -euo pipefail
python=${1:?usage: build-llama-server.sh PYTHON [llama-cpp-python version]}
version=${2:-0.3.36}
root="$(cd "$(dirname "$0")/.." && pwd)/.cache/llama.cpp"
target="$root/bin/llama-server"
if [ -x "$target" ]; then
    echo "llama-server already built: $target"
    exit 0
fi
mkdir -p "$root/src" "$root/bin"
"$python" -m pip download -q --no-deps --no-binary :all: -d "$root/src" "llama-cpp-python==$version"
tar -xzf "$root/src/llama_cpp_python-$version.tar.gz" -C "$root/src"
sources="$root/src/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$sources" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >/dev/null
cmake --build "$root/build" --target llama-server -j "$(nproc)"
cp "$root/build/bin/llama-server" "$target"
echo "built $target"
