"""Tiny vision-language models for tests: random weights (named as such), the real SmolLM2
tokenizer with the family's image tokens added, and the family's real processor classes and
chat template, so prompts expand images into placeholder tokens exactly as in production."""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import AutoTokenizer

from tests.support.models import default_model_dir, test_cache_dir
from tests.support.qwen import build_once

# SmolVLM's chat template (content is always a list of parts).
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def tiny_random_idefics3_dir(seed: int = 0) -> Path:
    """An Idefics3 (SmolVLM's architecture): a 2-layer SigLIP-style tower on 32-pixel tiles of
    8-pixel patches, pixel-shuffled by 2 into 4 tokens a tile, and a 2-layer Llama, 64 wide."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    def build(staging: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
        row_col = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
        tokenizer.add_special_tokens(
            {"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<end_of_utterance>",
                                           "<global-img>", *row_col]}
        )  # fmt: skip
        image_processor = Idefics3ImageProcessorPil(
            do_image_splitting=True, size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        )
        processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4, chat_template=SMOLVLM_CHAT_TEMPLATE)
        config = Idefics3Config(
            text_config={
                "model_type": "llama", "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "tie_word_embeddings": False,
                "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": tokenizer.eos_token_id,
            },
            vision_config={
                "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "image_size": 32, "patch_size": 8,
            },
            scale_factor=2,
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(seed)
        Idefics3ForConditionalGeneration(config).save_pretrained(staging)
        processor.save_pretrained(staging)

    return build_once(test_cache_dir() / f"tiny-random-idefics3-{seed}", build)


def sample_image(width: int = 48, height: int = 40, seed: int = 0) -> Image.Image:
    """A small RGB image with some structure (random blocks), the same for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height // 8 + 1, width // 8 + 1, 3), generator=generator, dtype=torch.uint8)
    blocks = pixels.repeat_interleave(8, 0).repeat_interleave(8, 1)[:height, :width]
    return Image.fromarray(blocks.numpy(), "RGB")


# Qwen2-VL's chat template, shortened to what tests send (no system default, no video).
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def tiny_random_qwen_vl_dir(kind: str, seed: int = 0) -> Path:
    """A Qwen2-VL, Qwen2.5-VL or Qwen3-VL: a 2-layer vision tower on 8-pixel patches merged 2×2,
    and a 2-layer language model 64 wide with multimodal RoPE (Qwen3-VL: interleaved, q/k norms
    and one deepstack layer), on Qwen's tokenizer (``tests/support/qwen.py``)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.support.qwen import qwen3_tokenizer_dir

    def build(staging: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
        tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=16 * 16, max_pixels=64 * 64, patch_size=8, merge_size=2, temporal_patch_size=2
        )
        rope: dict[str, object] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        text: dict[str, object] = {
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
            "rope_parameters": rope, "tie_word_embeddings": False,
        }  # fmt: skip
        tower: dict[str, object] = {"depth": 2, "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2}
        if kind == "qwen2_vl":
            tower |= {"embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
            config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
        elif kind == "qwen2_5_vl":
            tower |= {"hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                      "window_size": 32, "fullatt_block_indexes": [1]}  # fmt: skip
            config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
        else:
            tower |= {"hidden_size": 32, "out_hidden_size": 64, "intermediate_size": 64, "num_heads": 2,
                      "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}  # fmt: skip
            text |= {"head_dim": 16, "rope_parameters": {**rope, "mrope_interleaved": True}}
            config_class, model_class = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
        config = config_class(
            text_config=text, vision_config=tower, tie_word_embeddings=False,
            image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
        )  # fmt: skip
        torch.manual_seed(seed)
        model_class(config).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        image_processor.save_pretrained(staging)

    return build_once(test_cache_dir() / f"tiny-random-{kind}-{seed}", build)
