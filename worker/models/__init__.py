"""Model loading: the default GGUF, named opt-in models, local folders."""
