"""The language model's own configuration, wherever a checkpoint keeps it."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """Multimodal configs nest the text model's settings (transformers' ``get_text_config``);
    plain configs, and relaylm's native ``DecoderSpec``, are those settings themselves."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if get_text_config is not None else config
