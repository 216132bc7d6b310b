"""LoRA adapters: PEFT's files read and checked (``worker/native/peft_format.py``), made
ready for the loaded model (``for_model``), and kept per worker (``cache.py``)."""
