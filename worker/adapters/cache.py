"""The adapters one worker holds ready: read from the files the worker was started with
(``--lora``) or fetched from Redis on an adapter's first request, at most ``max_loaded`` of them,
the least recently used let go first. A request running on an adapter keeps it (its engine
request holds it) even after it is let go here or unloaded from Redis: it finishes as it began.

An adapter let go is reported (``on_let_go``) with the latest claim of a job that ran on it here,
so that the worker stops saying it holds the adapter ready (``shared.placement.adapter_key``)
unless a later claim named it again."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shared.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from shared.adapters import AdapterRecord, digest
from worker.adapters.for_model import for_model
from worker.native.decoder import NativeCausalLM
from worker.native.lora import LoraModel
from worker.native.peft_format import PeftAdapter, read_peft


@dataclass(frozen=True)
class LocalAdapter:
    """An adapter named on the command line: its files and what they hold."""

    name: str
    config: bytes
    weights: bytes
    adapter: PeftAdapter

    @property
    def sha256(self) -> str:
        return digest(self.config, self.weights)


def parse_lora_flag(value: str | None) -> list[tuple[str, Path]]:
    """``name=path[,name=path...]``; ``ValueError`` naming what is wrong."""
    pairs: list[tuple[str, Path]] = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        name, sep, path = item.strip().partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes name=path pairs, not {item.strip()!r}")
        pairs.append((name, Path(path).expanduser()))
    return pairs


def read_local(name: str, folder: Path) -> LocalAdapter:
    """``AdapterError`` for an adapter relaylm cannot serve; ``OSError`` for missing files."""
    config, weights = (folder / CONFIG_FILE).read_bytes(), (folder / WEIGHTS_FILE).read_bytes()
    return LocalAdapter(name, config, weights, read_peft(config, weights))


class AdapterCache:
    def __init__(self, model: NativeCausalLM, exact: bool, max_loaded: int, max_rank: int) -> None:
        """``exact``: the model runs on the exact kernels (the execution plan's numerics)."""
        self._model = model
        self._exact = exact
        self.max_loaded = max_loaded
        self.max_rank = max_rank
        self._ready: OrderedDict[tuple[str, str], LoraModel] = OrderedDict()  # (name, sha256) → adapter
        self._claimed_ms: dict[str, int] = {}  # name → the latest claim (ms) of a job that ran on it here
        self._lock = threading.Lock()  # the prepare thread adds, the event loop looks up
        self.on_let_go: Callable[[list[tuple[str, int]]], None] | None = None  # names let go, each with its claim

    def claimed(self, name: str, claimed_ms: int) -> None:
        """A job claimed at ``claimed_ms`` runs on adapter ``name`` here."""
        with self._lock:
            self._claimed_ms[name] = max(self._claimed_ms.get(name, 0), claimed_ms)

    def get(self, record: AdapterRecord) -> LoraModel | None:
        with self._lock:
            ready = self._ready.get((record.name, record.sha256))
            if ready is not None:
                self._ready.move_to_end((record.name, record.sha256))
            return ready

    def make(self, name: str, sha256: str, adapter: PeftAdapter) -> LoraModel:
        """Check ``adapter`` against the model and make it ready (``AdapterError`` where it does not fit)."""
        ready = for_model(self._model, name, sha256, adapter, self.max_rank, self._exact)
        let_go: list[tuple[str, int]] = []
        with self._lock:
            for key in [key for key in self._ready if key[0] == name]:
                del self._ready[key]  # an older version of the name
            self._ready[(name, sha256)] = ready
            while len(self._ready) > self.max_loaded:
                (gone, _), _ = self._ready.popitem(last=False)
                let_go.append((gone, self._claimed_ms.pop(gone, 0)))
        if let_go and self.on_let_go is not None:
            self.on_let_go(let_go)
        return ready

    def make_from_files(self, record: AdapterRecord, config: bytes, weights: bytes) -> LoraModel:
        return self.make(record.name, record.sha256, read_peft(config, weights))
