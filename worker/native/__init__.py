"""relaylm's own forward pass for the Llama family (Llama, Mistral, Qwen2, Qwen3): read from the
checkpoint's ``config.json`` and safetensors without importing transformers' configuration or
modeling code, which costs a new worker seconds of start-up (see docs/design/engine.md, "Start-up")."""
