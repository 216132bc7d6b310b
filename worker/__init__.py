"""Worker: pulls chat jobs from Redis (arq), runs them in the batching engine, publishes events."""
