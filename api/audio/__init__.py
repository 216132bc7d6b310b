"""Audio uploads: decoding to 16 kHz mono samples and cutting recordings into windows."""
