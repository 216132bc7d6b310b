"""A GGUF file served as it is (``--model /path/to/model.gguf``): its quantized weights go
straight into the exact kernels' packed layout, with no float copy of the matmuls' weights on the
way, so a 30B mixture of experts at 4 bits loads in the memory of its file, not of its bf16 copy.

- **What it reads:** the ``llama``, ``qwen2``, ``qwen3`` and ``qwen3moe`` architectures, from
  the file's metadata; the tokenizer and chat template the file carries (converted once by
  transformers, cached under ``--cache-dir``).
- **Weights:** 4-bit groups (Q4_0, Q4_1, Q4_K) are the kernels' own 4-bit groups, exactly the
  file's numbers (``gguf_groups.py``); Q8_0 blocks are the kernels' 8-bit groups, exactly; any
  other type (Q5_*, Q6_K, Q2_K, Q3_K, F16, F32) is widened to 8-bit groups of 32. A joined
  projection (q/k/v, gate/up) whose parts are not all 4-bit is 8-bit as a whole. The token
  embedding is a lookup table in the serving dtype; norms and biases are as the file has them.
- **Numerics:** the exact kernels only (``--deterministic on``): the library kernels would need
  float weights, the copy this path exists to avoid.

Llama files store the q and k rows of each head interleaved for llama.cpp's RoPE; they are put
back into transformers' order (the decoder's), a permutation of whole rows.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.native import exact
from worker.native.decoder import ExactMlp, ExactParts, NativeCausalLM
from worker.native.deterministic import ExactSummary
from worker.native.experts import ExactExperts, SparseMoe
from worker.native.gguf_file import GGUFFile
from worker.native.gguf_groups import Int4Groups, read_groups
from worker.native.spec import DecoderSpec, MoeSpec, UnsupportedCheckpoint

logger = logging.getLogger(__name__)

# general.architecture → (the decoder's model_type, q/k norms, q/k rows interleaved by llama.cpp)
_ARCHITECTURES = {
    "llama": ("llama", False, True),
    "qwen2": ("qwen2", False, False),
    "qwen3": ("qwen3", True, False),
    "qwen3moe": ("qwen3_moe", True, False),
}
_Q8_0_BLOCK = 34


def is_gguf_file(source: str) -> bool:
    path = Path(source)
    return path.suffix == ".gguf" and path.is_file()


def read_gguf_spec(gguf: GGUFFile) -> DecoderSpec:
    if gguf.architecture not in _ARCHITECTURES:
        raise UnsupportedCheckpoint(f"GGUF architecture {gguf.architecture!r}")
    model_type, qk_norm, _ = _ARCHITECTURES[gguf.architecture]
    scaling = gguf.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedCheckpoint(f"rope scaling {scaling!r}")
    if gguf.arch_value("attention.sliding_window"):
        raise UnsupportedCheckpoint("sliding-window attention")
    hidden = int(gguf.arch_value("embedding_length"))
    heads = int(gguf.arch_value("attention.head_count"))
    layers = int(gguf.arch_value("block_count"))
    if "rope_freqs.weight" in gguf.tensors:
        raise UnsupportedCheckpoint("scaled RoPE (rope_freqs)")
    embedding_shape = gguf.tensors["token_embd.weight"].shape
    moe = None
    if gguf.architecture == "qwen3moe":
        # llama.cpp renormalises Qwen3-MoE's chosen experts' weights always (as the model's config says).
        moe = MoeSpec(
            num_experts=int(gguf.arch_value("expert_count")),
            top_k=int(gguf.arch_value("expert_used_count")),
            intermediate_size=int(gguf.arch_value("expert_feed_forward_length")),
            norm_topk_prob=True,
            sparse_layers=frozenset(i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in gguf.tensors),
        )
    spec = DecoderSpec(
        model_type=model_type,
        vocab_size=embedding_shape[0],
        hidden_size=hidden,
        intermediate_size=int(gguf.arch_value("feed_forward_length", 0)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(gguf.arch_value("attention.head_count_kv", heads)),
        head_dim=int(gguf.arch_value("attention.key_length", hidden // heads)),
        rms_norm_eps=float(gguf.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(gguf.arch_value("rope.freq_base", 10000.0)),
        max_position_embeddings=int(gguf.arch_value("context_length", 2048)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        qk_norm=qk_norm,
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        o_proj_bias="blk.0.attn_output.bias" in gguf.tensors,
        mlp_bias="blk.0.ffn_gate.bias" in gguf.tensors,
        weight_files=(gguf.path,),
        moe=moe,
    )
    unexpected = sorted(set(gguf.tensors) - _expected_tensors(spec))
    if unexpected:
        raise UnsupportedCheckpoint(f"unexpected tensor {unexpected[0]!r} for a {gguf.architecture} decoder")
    return spec


def _expected_tensors(spec: DecoderSpec) -> set[str]:
    names = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(spec.num_hidden_layers):
        blk = f"blk.{i}"
        names |= {
            f"{blk}.{part}.weight" for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm")
        }
        names |= {f"{blk}.attn_{part}.bias" for part in ("q", "k", "v", "output")}
        names |= {f"{blk}.attn_q_norm.weight", f"{blk}.attn_k_norm.weight"}
        parts = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if spec.is_sparse(i) else (
            "ffn_gate", "ffn_up", "ffn_down")  # fmt: skip
        names |= {f"{blk}.{part}.weight" for part in parts} | {f"{blk}.{part}.bias" for part in parts}
    return names


def gguf_tokenizer_dir(path: Path, cache_dir: Path) -> Path:
    """The tokenizer and chat template the file carries, converted by transformers once and kept
    under ``cache_dir`` (keyed by the file's name, size and modification time)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / "gguf-tokenizers" / f"{path.stem}-{key}"
    if (target / ".converted").exists():
        return target
    from transformers import AutoTokenizer

    staging = target.with_name(target.name + f".partial-{id(target)}")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(staging)
    (staging / ".converted").touch()
    with contextlib.suppress(OSError):  # another process converted it first
        staging.rename(target)
    return target


def gguf_eos_token_ids(gguf: GGUFFile) -> set[int]:
    value = gguf.value("tokenizer.ggml.eos_token_id")
    return set() if value is None else {int(value)}


class _Packer:
    """Each matmul's weight from the file into the kernels' layout."""

    def __init__(self, gguf: GGUFFile, spec: DecoderSpec, dtype: torch.dtype) -> None:
        self.gguf = gguf
        self.spec = spec
        self.dtype = dtype
        self.interleaved = _ARCHITECTURES[gguf.architecture][2]
        self.summary = ExactSummary()

    def _rows(self, name: str) -> torch.Tensor | None:
        """The permutation taking a llama file's q/k rows to transformers' order (None: as stored)."""
        if not self.interleaved or not name.endswith(("attn_q.weight", "attn_k.weight")):
            return None
        heads = self.spec.num_attention_heads if "attn_q" in name else self.spec.num_key_value_heads
        half = self.spec.head_dim // 2
        # llama.cpp stores row (h, i, j) at what transformers has as (h, j, i), j in {0, 1}.
        return torch.arange(heads * 2 * half).view(heads, half, 2).transpose(1, 2).reshape(-1)

    def groups(self, name: str, index: int | None = None) -> Int4Groups | None:
        """A 2-D weight's (or one expert's of a 3-D one) 4-bit groups; None where it is not 4-bit."""
        tensor = self.gguf.tensors[name]
        data, shape = (tensor.data, tensor.shape) if index is None else (tensor.data[index], tensor.shape[1:])
        groups = read_groups(np.asarray(data), tensor.type.name, (shape[0], shape[1]))
        order = self._rows(name)
        return groups if groups is None or order is None else groups.permute_rows(order)

    def floats(self, name: str, index: int | None = None) -> torch.Tensor:
        """Widened weights in the serving dtype, as a converted checkpoint holds them (so a file
        and its conversion pack to the same bits)."""
        weight = self.gguf.float_tensor(name, index)
        order = self._rows(name)
        return (weight if order is None else weight[order]).to(self.dtype)

    def pack(self, names: list[str], index: int | None = None) -> exact.PackedWeight:
        """The weights ``names`` stacked in row order, as one packed weight."""
        groups = [self.groups(name, index) for name in names]
        if all(g is not None for g in groups):
            packed = Int4Groups.joined([g for g in groups if g is not None]).pack()
            self.summary.gguf_int4 += 1
        elif len(names) == 1 and self.gguf.tensors[names[0]].type.name == "Q8_0":
            packed = self._q8_0(names[0], index)
            self.summary.int8 += 1
        else:
            packed = exact.pack_int8(torch.cat([self.floats(name, index) for name in names]))
            self.summary.int8 += 1
        self.summary.nbytes += packed.nbytes
        return packed

    def _q8_0(self, name: str, index: int | None) -> exact.PackedWeight:
        """Q8_0 blocks (a float16 scale, 32 signed bytes) as 8-bit groups with the zero point 128."""
        tensor = self.gguf.tensors[name]
        data, shape = (tensor.data, tensor.shape) if index is None else (tensor.data[index], tensor.shape[1:])
        out, width = shape
        blocks = np.ascontiguousarray(data).reshape(-1, _Q8_0_BLOCK)
        scales = torch.from_numpy(blocks[:, :2].copy().view(np.float16).astype(np.float32)).reshape(out, -1)
        values = torch.from_numpy((blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8))
        values = values.reshape(out, width)
        order = self._rows(name)
        if order is not None:
            values, scales = values[order], scales[order]
        return exact.pack(values.contiguous(), scales, None, 128, 8)

    def linear(self, names: list[str], index: int | None = None, **kwargs: Any) -> exact.ExactLinear:
        bias_names = [name.replace(".weight", ".bias") for name in names]
        bias = None
        if index is None and all(name in self.gguf.tensors for name in bias_names):
            bias = torch.cat([self.gguf.float_tensor(name) for name in bias_names])
        return exact.ExactLinear(self.pack(names, index), bias, **kwargs)


def load_gguf_exact(gguf: GGUFFile, spec: DecoderSpec, dtype: torch.dtype) -> tuple[NativeCausalLM, ExactSummary]:
    """The decoder on the exact kernels, its matmuls packed from the file's blocks."""
    if not exact.available():
        raise UnsupportedCheckpoint("a GGUF file is served on the exact kernels, which could not be built here")
    with torch.device("meta"):
        model = NativeCausalLM(spec)
    packer = _Packer(gguf, spec, dtype)
    small = {name: gguf.float_tensor(gguf_name).to(dtype) for name, gguf_name in _small_weights(spec).items()}
    _assign(model, small)
    for i, layer in enumerate(model.model.decoder_layers()):
        blk = f"blk.{i}"
        input_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        qkv = packer.linear(
            [f"{blk}.attn_{part}.weight" for part in ("q", "k", "v")],
            prologue=exact.PROLOGUE_RMS_NORM,
            norm_weight=input_norm.weight,
            eps=input_norm.eps,
        )
        output = packer.linear([f"{blk}.attn_output.weight"])
        mlp: ExactMlp | ExactExperts
        if isinstance(layer.mlp, SparseMoe):
            mlp = _experts(packer, blk, layer.mlp.moe, post_norm.weight, post_norm.eps)
        else:
            mlp = ExactMlp(
                gate_up=packer.linear(
                    [f"{blk}.ffn_gate.weight", f"{blk}.ffn_up.weight"],
                    prologue=exact.PROLOGUE_RMS_NORM,
                    norm_weight=post_norm.weight,
                    eps=post_norm.eps,
                ),
                down=packer.linear([f"{blk}.ffn_down.weight"], prologue=exact.PROLOGUE_SILU_MUL),
            )
        layer.exact = ExactParts(qkv=qkv, o=output, mlp=mlp)
    head_name = "token_embd.weight" if spec.tie_word_embeddings else "output.weight"
    head = exact.pack_int8(packer.floats(head_name))
    packer.summary.int8 += 1
    packer.summary.nbytes += head.nbytes
    model.exact_head = exact.ExactLinear(
        head, None, exact.PROLOGUE_RMS_NORM, model.model.norm.weight, model.model.norm.eps, out_float32=True
    )
    model.set_rope(torch.device("cpu"))
    _return_freed_memory()
    return model.eval().requires_grad_(False), packer.summary


def _return_freed_memory() -> None:
    """Packing frees as much as it keeps (each weight is decoded, then repacked), and glibc's
    allocator holds freed pages for reuse: ~0.3 GB of a 1 GB file's load stayed resident
    (``bench/moe_bench.py``). Hand them back to the system (glibc only; elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _small_weights(spec: DecoderSpec) -> dict[str, str]:
    """The decoder's names of the weights kept as tensors (embedding, norms), and the file's."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(spec.num_hidden_layers):
        layer, blk = f"model.layers.{i}", f"blk.{i}"
        names[f"{layer}.input_layernorm.weight"] = f"{blk}.attn_norm.weight"
        names[f"{layer}.post_attention_layernorm.weight"] = f"{blk}.ffn_norm.weight"
        if spec.qk_norm:
            names[f"{layer}.self_attn.q_norm.weight"] = f"{blk}.attn_q_norm.weight"
            names[f"{layer}.self_attn.k_norm.weight"] = f"{blk}.attn_k_norm.weight"
    return names


def _experts(packer: _Packer, blk: str, moe: MoeSpec, norm_weight: torch.Tensor, eps: float) -> ExactExperts:
    experts = range(moe.num_experts)
    gate_up = [packer.pack([f"{blk}.ffn_gate_exps.weight", f"{blk}.ffn_up_exps.weight"], e) for e in experts]
    down = [packer.pack([f"{blk}.ffn_down_exps.weight"], e) for e in experts]
    router = exact.pack_int8(packer.floats(f"{blk}.ffn_gate_inp.weight"))
    packer.summary.int8 += 1
    packer.summary.nbytes += router.nbytes
    return ExactExperts.build(moe, router, gate_up, down, norm_weight, eps)


def _assign(model: NativeCausalLM, small: dict[str, torch.Tensor]) -> None:
    """The embedding, norms and rope live as parameters; the matmuls' float weights stay empty."""
    for name, _ in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        value = small.get(name, torch.empty(0, dtype=small["model.embed_tokens.weight"].dtype))
        setattr(module, attr, torch.nn.Parameter(value, requires_grad=False))
