"""LoRA adapters in PEFT's own format, written by PEFT over a test model, with random weights in
both halves (PEFT starts ``lora_B`` at zero, which would make every adapter the base model)."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_peft_adapter(
    base: Path, folder: Path, seed: int, rank: int = 8, targets: tuple[str, ...] = ALL_TARGETS,
    alpha: int = 16, scale: float = 0.05,
) -> Path:  # fmt: skip
    """An adapter of ``base`` saved by PEFT into ``folder`` (``adapter_config.json`` and
    ``adapter_model.safetensors``)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets)))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(folder)
    return folder


def peft_reference(base: Path, adapter: Path) -> torch.nn.Module:
    """transformers + PEFT in fp32: the numbers an adapter is held to."""
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    return PeftModel.from_pretrained(model, adapter).eval()
