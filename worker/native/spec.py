"""What the native decoder needs to know about a checkpoint, read from its files, and whether it
can serve it at all (anything it does not implement goes to transformers instead)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

# model_type → whether its attention normalises q and k per head (Qwen3) before RoPE.
_ARCHITECTURES = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True, "qwen3_moe": True}
# Vision-language checkpoints whose language model is one of those: model_type → its language
# model's type. The language model's weights sit under ``model.text_model.`` (Idefics3, SmolVLM),
# ``model.language_model.`` (Qwen3-VL, and checkpoints written by transformers 5) or ``model.``
# (Qwen2-VL, Qwen2.5-VL as published); the vision tower's are the vision model's (``worker/vision``).
_VISION_LANGUAGE_MODELS = {
    "idefics3": "llama", "smolvlm": "llama", "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3",
}  # fmt: skip
_BODY_PREFIXES = ("model.text_model.", "model.language_model.")


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP (Qwen3-MoE): each token's ``top_k`` experts of ``num_experts``,
    chosen by a softmax router, their outputs summed with the router's weights."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (``moe_intermediate_size``)
    norm_topk_prob: bool  # the chosen experts' weights renormalised to sum to one
    sparse_layers: frozenset[int]  # the layers whose MLP is the experts (the rest are dense)


@dataclass(frozen=True)
class DecoderSpec:
    """The shape of a Llama-family decoder. Attribute names follow transformers' configs, so the
    KV cache layout reads either."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    weight_files: tuple[Path, ...]
    body_prefix: str = "model."  # where the checkpoint keeps the decoder body's weights
    foreign_prefixes: tuple[str, ...] = ()  # weights of other parts (a vision tower), not the decoder's
    # Multimodal RoPE (Qwen-VL): the rotary half-dimensions' sections taken from the temporal,
    # height and width positions, in blocks (Qwen2-VL) or interleaved (Qwen3-VL).
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    moe: MoeSpec | None = None  # the experts of a mixture-of-experts model's sparse layers

    def is_sparse(self, layer_idx: int) -> bool:
        return self.moe is not None and layer_idx in self.moe.sparse_layers


class UnsupportedCheckpoint(Exception):
    """The native decoder does not implement this checkpoint; the reason says what."""


def _rope_theta(config: dict[str, object]) -> float:
    """transformers 5 writes ``rope_parameters``; older checkpoints ``rope_theta`` + ``rope_scaling``."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(parameters, dict):
        raise UnsupportedCheckpoint(f"unreadable rope parameters {parameters!r}")
    rope_type = parameters.get("rope_type", parameters.get("type", "default"))
    if rope_type not in ("default", "mrope"):  # Qwen2-VL's published configs name multimodal RoPE "mrope"
        raise UnsupportedCheckpoint(f"rope type {rope_type!r}")
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def _weight_files(folder: Path) -> tuple[Path, ...]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return tuple(folder / shard for shard in shards)
    single = folder / "model.safetensors"
    if single.is_file():
        return (single,)
    raise UnsupportedCheckpoint("no safetensors weights")


def _weight_names(files: tuple[Path, ...]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def read_decoder_spec(folder: Path) -> DecoderSpec:
    """The spec of the checkpoint in ``folder``, or ``UnsupportedCheckpoint`` saying why not."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UnsupportedCheckpoint("no local config.json")
    config = json.loads(config_path.read_text())
    files = _weight_files(folder)
    names = _weight_names(files)
    body_prefix, foreign_prefixes = "model.", tuple[str, ...]()
    if config.get("model_type") in _VISION_LANGUAGE_MODELS:
        body_prefix = next((p for p in _BODY_PREFIXES if any(n.startswith(p) for n in names)), "model.")
        foreign_prefixes = ("visual.",) if body_prefix == "model." else ("model.", "visual.")
        language_type = _VISION_LANGUAGE_MODELS[config["model_type"]]
        top_tie = config.get("tie_word_embeddings", False)
        config = {"tie_word_embeddings": top_tie, **config.get("text_config", {}), "model_type": language_type}
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise UnsupportedCheckpoint(f"model type {model_type!r}")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedCheckpoint(f"activation {config['hidden_act']!r}")
    if config.get("use_sliding_window") or (model_type == "mistral" and config.get("sliding_window")):
        raise UnsupportedCheckpoint("sliding-window attention")
    if config.get("pretraining_tp", 1) != 1:
        raise UnsupportedCheckpoint("pretraining_tp > 1")
    num_heads = int(config["num_attention_heads"])
    mrope = _mrope(config)
    return DecoderSpec(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(config.get("max_position_embeddings") or 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=_ARCHITECTURES[model_type],
        # Biases differ by family (Qwen2: q, k, v but not o): the checkpoint's names say which.
        qkv_bias=f"{body_prefix}layers.0.self_attn.q_proj.bias" in names,
        o_proj_bias=f"{body_prefix}layers.0.self_attn.o_proj.bias" in names,
        mlp_bias=f"{body_prefix}layers.0.mlp.gate_proj.bias" in names,
        weight_files=files,
        body_prefix=body_prefix,
        foreign_prefixes=foreign_prefixes,
        mrope_section=mrope[0] if mrope else None,
        mrope_interleaved=mrope[1] if mrope else False,
        moe=_moe(config) if model_type == "qwen3_moe" else None,
    )


def _moe(config: dict[str, Any]) -> MoeSpec:
    """Qwen3-MoE's experts, placed as transformers places them: every ``decoder_sparse_step``-th
    layer that ``mlp_only_layers`` does not keep dense."""
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)  # published | transformers 5
    top_k = int(config.get("num_experts_per_tok") or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise UnsupportedCheckpoint(f"{num_experts} experts with {top_k} per token")
    if config.get("shared_expert_intermediate_size"):
        raise UnsupportedCheckpoint("shared experts")
    step = int(config.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in config.get("mlp_only_layers") or []}
    layers = int(config["num_hidden_layers"])
    return MoeSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sparse_layers=frozenset(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
    )


def _mrope(config: dict[str, object]) -> tuple[tuple[int, ...], bool] | None:
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(parameters, dict) or "mrope_section" not in parameters:
        return None
    section = tuple(int(n) for n in parameters["mrope_section"])
    return section, bool(parameters.get("mrope_interleaved", False))


def read_eos_token_ids(folder: Path) -> set[int]:
    """End-of-sequence ids from ``generation_config.json`` (where chat models list several)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return set()
    value = json.loads(path.read_text()).get("eos_token_id")
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {int(v) for v in value}
    return set()
