"""Reasoning and tool-call parsers: pure, registered by name, one instance per sequence."""

# Importing the parser modules registers them by name.
from worker.parsers import hermes, qwen3_coder, qwen3_reasoning  # noqa: F401
