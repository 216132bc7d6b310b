"""The job service: claim jobs from Redis, run them, publish their events, register and heartbeat."""
