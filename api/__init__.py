"""HTTP front end: validates OpenAI requests, enqueues jobs, streams their events back as SSE."""
