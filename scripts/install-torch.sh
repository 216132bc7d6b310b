#!/usr/bin/env bash
# Install torch on purpose: for Linux, PyPI's default torch wheel is a multi-GB CUDA build.
#   RELAYLM_TORCH=auto (default): CUDA build when an NVIDIA GPU answers nvidia-smi, else the CPU build
#   RELAYLM_TORCH=cpu | cuda       force one
# The CPU build comes from a local wheel when pip knows one (find-links), else from PyTorch's CPU index.
set -euo pipefail
python=${1:?usage: install-torch.sh PYTHON}
version=${TORCH_VERSION:-2.13.0}
flavour=${RELAYLM_TORCH:-auto}

if "$python" -c "import torch" 2>/dev/null; then
    echo "torch $("$python" -c 'import torch; print(torch.__version__)') already installed"
    exit 0
fi
if [ "$flavour" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=cuda; else flavour=cpu; fi
fi
if [ "$flavour" = cuda ]; then
    echo "installing torch==$version (CUDA build from PyPI)"
    exec "$python" -m pip install -q "torch==$version"
fi
echo "installing torch==$version (CPU build)"
if "$python" -m pip install -q --no-index --no-deps "torch==$version" 2>/dev/null; then
    # The local wheel is in; now its dependencies (torch itself is already satisfied).
    "$python" -m pip install -q "torch==$version"
else
    "$python" -m pip install -q "torch==$version" \
        --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
fi
