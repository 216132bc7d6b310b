"""The in-process continuous-batching engine: no Redis, no HTTP; requests in, events out."""
