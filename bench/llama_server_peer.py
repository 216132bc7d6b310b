"""(d) llama.cpp's ``llama-server`` as a peer in ``make bench``: the same GGUF file, the same
prompts, the same streaming clients, in the same run.

The binary is ``$LLAMA_SERVER``, else ``llama-server`` on PATH, else the one
``make llama-server`` builds from the llama.cpp sources in the llama-cpp-python sdist
(``.cache/llama.cpp/bin/llama-server``). Without one the peer rows are skipped, and said so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.stack import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
BUILT = REPO_ROOT / ".cache" / "llama.cpp" / "bin" / "llama-server"
_START_TIMEOUT_S = 120.0


def find_llama_server() -> Path | None:
    for candidate in (os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"), str(BUILT)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


@contextlib.contextmanager
def running_llama_server(
    binary: Path, gguf: Path, parallel: int, context_per_slot: int, threads: int, extra_args: tuple[str, ...] = ()
) -> Iterator[str]:
    """``llama-server`` with ``parallel`` slots of ``context_per_slot`` tokens, on loopback;
    ``extra_args``: more of its options (a speculation mode)."""
    port = free_port()
    command = [
        str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
        "-c", str(parallel * context_per_slot), "-t", str(threads), "-tb", str(threads), "--no-webui",
        # Weight repacking puts Q4 weights on ggml's AMX path where the CPU has AMX; on this
        # workplace's Xeon VMs that path segfaults in ggml_backend_amx_mul_mat (build 0c1e570).
        "--no-repack", *extra_args,
    ]  # fmt: skip
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({process.returncode}); its log: {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server did not become healthy; its log: {log.name}")
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def version(binary: Path) -> str:
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), lines[0] if lines else "unknown")
