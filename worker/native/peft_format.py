"""A PEFT LoRA adapter's tensors, loaded: ``shared.adapter_files`` reads and checks the files
(the API checks them the same way before storing an adapter), this loads the factors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from shared.adapter_files import WEIGHTS_FILE, AdapterError, Update, read_adapter


@dataclass(frozen=True)
class LoraPair:
    """One projection's low-rank update ``W + scaling * B @ A``: ``a`` ``[rank, in]``, ``b`` ``[out, rank]`` (fp32)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter's updates by ``(layer, target)``, as read."""

    rank: int  # the config's ``r``
    targets: frozenset[str]
    updates: dict[tuple[int, str], Update]  # what the files say of each (names, shapes)
    pairs: dict[tuple[int, str], LoraPair]


def read_peft(config_json: bytes, weights: bytes) -> PeftAdapter:
    """Parse and load an adapter; ``AdapterError`` for anything relaylm does not serve."""
    config, found = read_adapter(config_json, weights)
    try:
        tensors = load_safetensors(weights)
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterError(WEIGHTS_FILE, f"not a safetensors file ({exc})") from exc
    pairs = {
        where: LoraPair(
            tensors[update.a_key].float().contiguous(),
            tensors[update.b_key].float().contiguous(),
            config.scaling(update.rank),
        )
        for where, update in found.items()
    }
    return PeftAdapter(config.rank, frozenset(target for _, target in found), found, pairs)
