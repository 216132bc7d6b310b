"""OpenAI wire models shared by the API (which validates and renders them) and the worker."""
