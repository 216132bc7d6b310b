"""What the API and the workers must agree on: the job contract, events, the job lifecycle, Redis keys, settings."""
