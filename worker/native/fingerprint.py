"""What a result computed on this machine depends on, as digests: the weights, the worker's code
and the CPU. A result cached under such a key (a compiled step, a passed self-test) is reused
only where all of them are the same."""

from __future__ import annotations

import hashlib
import platform
from functools import cache
from pathlib import Path

import torch

from worker.native.exact import PackedWeight

WORKER_ROOT = Path(__file__).resolve().parent.parent
_CODE_SUFFIXES = (".py", ".cpp", ".h")


def update_with_weights(digest: hashlib.blake2b, model: torch.nn.Module) -> None:
    """Each parameter's and buffer's name, shape, dtype and first and last bytes, and those of the
    exact kernels' packed weights (held by the layers' ``exact`` parts, outside the parameters,
    alone or in an ``ExactLinear``): a different checkpoint, quantization or dtype changes it, and
    it costs milliseconds, not a read of every weight."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers(), *_packed_weights(model)]:
        flat = tensor.detach().reshape(-1)
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        for part in (flat[:64], flat[-64:]):
            digest.update(part.contiguous().view(torch.uint8).numpy().tobytes())


def _packed_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: object, name: str) -> None:
        if isinstance(value, tuple):
            for index, item in enumerate(value):
                walk(item, f"{name}.{index}")
        packed = value if isinstance(value, PackedWeight) else getattr(value, "packed", None)
        if isinstance(packed, PackedWeight):
            for part in ("data", "scales", "super_scales"):
                tensor = getattr(packed, part)
                if tensor is not None:
                    found.append((f"{name}.{part}", tensor))

    for module_name, module in model.named_modules():
        parts = getattr(module, "exact", None)
        if isinstance(parts, tuple):
            walk(parts, f"{module_name}.exact")
    return found


@cache
def code_digest() -> str:
    """Every source file of the worker package (Python and the kernels' C++), by path and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for path in sorted(p for p in WORKER_ROOT.rglob("*") if p.suffix in _CODE_SUFFIXES and p.is_file()):
        digest.update(str(path.relative_to(WORKER_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@cache
def machine_digest() -> str:
    """The CPU (model and feature flags, as the kernel reports them), the instruction set torch
    dispatches to, and the versions of torch and Python."""
    cpu = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text(errors="replace").splitlines()
        cpu = "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags", "Features"))}))
    identity = [
        cpu,
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
        torch.__version__,
        platform.python_version(),
    ]
    return hashlib.blake2b("\0".join(identity).encode(), digest_size=16).hexdigest()
