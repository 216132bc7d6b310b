"""Vision-language models on the engine, against transformers' own forward on the same tiny
random-weight model and inputs (fp32): prefill logits, greedy text alone and batched with
text-only requests (prefill chunks that cut through an image), and a repeated image served from
the image and prefix caches with identical output."""

from __future__ import annotations

import functools
import hashlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from shared.contract import ImageRef
from tests.support.vision import QWEN_VL_FAMILIES, sample_image, tiny_random_idefics3_dir, tiny_random_qwen_vl_dir
from tests.worker.test_engine import Collector, _drain
from worker.engine.builder import EngineConfig, build_engine
from worker.engine.engine import LLMEngine
from worker.engine.prefix_cache import BLOCK_SIZE
from worker.engine.sampling_params import SamplingParams
from worker.engine.sequence import EngineRequest
from worker.models.loader import LoadedModel, load_model
from worker.native.kv_cache import KVCacheLayout
from worker.vision.families import Idefics3Family

MAX_LEN = 512
FAMILIES: dict[str, Callable[[], Path]] = {
    "idefics3": tiny_random_idefics3_dir,
    **{kind: functools.partial(tiny_random_qwen_vl_dir, kind) for kind in QWEN_VL_FAMILIES},
}


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _ref(data: bytes, image: Image.Image) -> ImageRef:
    return ImageRef(
        sha256=hashlib.sha256(data).hexdigest(), media_type="image/png", width=image.width, height=image.height
    )


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> tuple[LoadedModel, Any]:
    """The worker's load of the tiny model, and transformers' own model of it."""
    from transformers import AutoModelForImageTextToText

    folder = FAMILIES[request.param]()
    loaded = load_model(str(folder), folder.parent, "cpu", "float32", MAX_LEN, quantization="none")
    reference = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    return loaded, reference.eval()


def _engine(loaded: LoadedModel, budget: int = 512, prefix_blocks: int = 0) -> tuple[LLMEngine, Collector]:
    layout = KVCacheLayout.from_config(loaded.model.config, torch.float32, torch.device("cpu"))
    config = EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=MAX_LEN,
        kv_cache_bytes=9 * layout.bytes_per_token * MAX_LEN,
        prefix_cache_bytes=prefix_blocks * layout.bytes_per_token * BLOCK_SIZE,
    )  # fmt: skip
    collector = Collector()
    return build_engine(loaded.model, loaded.tokenizer, config, loaded.eos_token_ids, collector), collector


def _conversation(question: str, num_images: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*({"type": "image"} for _ in range(num_images)),
                                         {"type": "text", "text": question}]}]  # fmt: skip


def _request(
    loaded: LoadedModel,
    request_id: str,
    images: list[Image.Image],
    question: str = "What is in the picture?",
    max_new: int = 8,
) -> tuple[EngineRequest, str]:
    assert loaded.vision is not None
    conversation = _conversation(question, len(images))
    text = loaded.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    blobs = [_png(image) for image in images]
    refs = [_ref(data, image) for data, image in zip(blobs, images, strict=True)]
    stored = {ref.sha256: data for ref, data in zip(refs, blobs, strict=True)}
    ids, prompt_images = loaded.vision.prompt(str(text), refs, stored)
    params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    return EngineRequest(request_id, [ids], params, images=prompt_images), str(text)


def _reference_inputs(loaded: LoadedModel, request: EngineRequest, text: str, images: list[Image.Image]) -> Any:
    """The reference model's inputs for the same prompt: Idefics3's own processor; for Qwen-VL,
    the worker's token ids with the image processor's pixels and grids (transformers' Qwen-VL
    processors need torchvision for their video half), positions left to the reference model."""
    assert loaded.vision is not None
    decoded = [Image.open(io.BytesIO(_png(image))).convert("RGB") for image in images]  # the bytes the worker reads
    family = loaded.vision.family
    if isinstance(family, Idefics3Family):
        inputs = family._processor(text=[text], images=[decoded], return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == request.prompts[0]
        return inputs
    pixels = [family.pixel_inputs(image) for image in decoded]
    input_ids = torch.tensor([request.prompts[0]])
    return {
        "input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
        "pixel_values": torch.cat([p["pixel_values"] for p in pixels]),
        "image_grid_thw": torch.cat([p["image_grid_thw"] for p in pixels]),
        "mm_token_type_ids": (input_ids == family.image_token_id).int(),
    }  # fmt: skip


def test_prefill_logits_equal_the_reference_forward(family: tuple[LoadedModel, Any]) -> None:
    loaded, reference = family
    assert loaded.vision is not None
    images = [sample_image(48, 40, seed=1), sample_image(30, 64, seed=2)]
    request, text = _request(loaded, "r", images)
    engine, collector = _engine(loaded)
    captured: list[torch.Tensor] = []
    prefill = engine.runner.prefill
    engine.runner.prefill = lambda chunks: captured.append(prefill(chunks)) or captured[-1]  # type: ignore[method-assign]
    engine.submit(request)
    _drain(engine, collector, {"r"})
    inputs = _reference_inputs(loaded, request, text, images)
    if not isinstance(loaded.vision.family, Idefics3Family):  # multimodal RoPE: later tokens' positions shift
        assert request.images is not None and request.images.rope_delta < 0
    with torch.inference_mode():
        expected = reference(**inputs).logits[0, -1]
    torch.testing.assert_close(captured[0][0], expected, atol=2e-5, rtol=1e-4)


def test_greedy_text_equals_the_reference_alone_and_batched_with_text(family: tuple[LoadedModel, Any]) -> None:
    loaded, reference = family
    images = [sample_image(64, 48, seed=3)]
    request, text = _request(loaded, "image", images, max_new=10)
    inputs = _reference_inputs(loaded, request, text, images)
    with torch.inference_mode():
        generated = reference.generate(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    expected = generated[0, inputs["input_ids"].shape[1] :].tolist()

    alone, alone_out = _engine(loaded)
    alone.submit(request)
    _drain(alone, alone_out, {"image"})
    assert request.sequences[0].output_token_ids == expected

    # A small token budget: prefill chunks cut through the image's placeholders, beside text rows.
    batched, batched_out = _engine(loaded, budget=24)
    again, _ = _request(loaded, "image", images, max_new=10)
    short = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    texts = [EngineRequest(f"text{i}", [loaded.tokenizer.encode(f"plain text prompt {i}")], short) for i in range(3)]
    batched.submit(texts[0])
    batched.submit(again)
    for other in texts[1:]:
        batched.submit(other)
    _drain(batched, batched_out, {"image", "text0", "text1", "text2"})
    assert again.sequences[0].output_token_ids == expected


def test_a_repeated_image_is_served_from_the_caches_with_identical_output(family: tuple[LoadedModel, Any]) -> None:
    loaded, _ = family
    assert loaded.vision is not None
    engine, collector = _engine(loaded, prefix_blocks=64)
    image = sample_image(56, 56, seed=4)
    question = "Describe every part of this picture, its colours and its shapes, in as much detail as you can. " * 3
    first, _ = _request(loaded, "first", [image], question)
    engine.submit(first)
    _drain(engine, collector, {"first"})
    hits, encoded = loaded.vision.stats.image_cache_hits, loaded.vision.stats.images_encoded
    second, _ = _request(loaded, "second", [image], question)
    engine.submit(second)
    _drain(engine, collector, {"second"})
    assert second.sequences[0].output_token_ids == first.sequences[0].output_token_ids
    assert loaded.vision.stats.image_cache_hits == hits + 1
    assert loaded.vision.stats.images_encoded == encoded
    assert second.images is not None
    assert second.num_cached_tokens > second.images.positions[-1]  # the image's keys and values too

    # Another image of the same size: the same placeholder ids, but its blocks are not the first's.
    other, _ = _request(loaded, "other", [sample_image(56, 56, seed=5)], question)
    engine.submit(other)
    _drain(engine, collector, {"other"})
    assert other.images is not None
    assert other.num_cached_tokens <= other.images.positions[0] // BLOCK_SIZE * BLOCK_SIZE
