"""Embedding workers: a sentence-transformers model and a micro-batching engine."""
