"""Whisper workers: named models from PyPI wheels, loading, and the transcription engine."""
