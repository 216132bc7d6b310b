"""What the API and the workers must agree on: wire schemas, job and event formats, Redis keys, settings."""
