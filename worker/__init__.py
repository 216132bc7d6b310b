"""Worker: claims jobs from Redis, runs them in the batching engine, publishes their events."""
