"""Every Redis key and channel relaylm uses, built in one place, each with its TTL beside it.

arq's own keys (``arq:job:<id>``, ``arq:in-progress:<id>``, ``arq:result:<id>``, ``arq:retry:<id>``)
are arq's constants; everything else lives under one configurable prefix so that several
deployments can share a Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

# A job's request payload and its cancel flag outlive any reasonable generation.
JOB_REQUEST_TTL_S = 24 * 3600
JOB_CANCEL_TTL_S = 3600
# A job's event log (for gaps, reconnects and resuming on another worker) outlives its last event by this.
JOB_LOG_TTL_S = 3600
JOB_LOG_MAX_EVENTS = 200_000
# A job is started at most this many times (the first worker, then takeovers after a worker dies).
JOB_MAX_ATTEMPTS = 3
# A worker that misses heartbeats for this long is considered dead.
WORKER_HEARTBEAT_TTL_S = 5
# A model no worker has served for this long is forgotten (404 instead of 503).
MODEL_FORGET_AFTER_S = 24 * 3600


@dataclass(frozen=True)
class RedisKeys:
    """Key builder bound to one deployment prefix."""

    prefix: str = "relaylm"

    # -- queues -----------------------------------------------------------------------------
    def queue(self, model: str) -> str:
        """arq queue (sorted set) of chat jobs for one model: workers only take their model's jobs."""
        return f"{self.prefix}:queue:{model}"

    def queue_wake_channel(self, model: str) -> str:
        """Pub/sub channel the API pings after enqueueing, so idle workers pick up at once."""
        return f"{self.prefix}:queue:{model}:wake"

    # -- jobs -------------------------------------------------------------------------------
    def job_request(self, job_id: str) -> str:
        """The job's request payload (msgpack); kept out of arq's args so prompts never reach logs."""
        return f"{self.prefix}:job:{job_id}:request"

    def job_events_channel(self, job_id: str) -> str:
        """Pub/sub channel carrying the job's event stream to the API."""
        return f"{self.prefix}:job:{job_id}:events"

    def job_event_log(self, job_id: str) -> str:
        """Redis Stream with every event of the job, beside the pub/sub channel that carries them live."""
        return f"{self.prefix}:job:{job_id}:log"

    def job_owner(self, job_id: str) -> str:
        """Worker id running the job (or "requeued" while a takeover waits for a new worker)."""
        return f"{self.prefix}:job:{job_id}:owner"

    def job_arq_id(self, job_id: str) -> str:
        """The arq job id of the current attempt (the first attempt's is the job id itself)."""
        return f"{self.prefix}:job:{job_id}:arq"

    def job_attempts(self, job_id: str) -> str:
        """How many times a worker started the job."""
        return f"{self.prefix}:job:{job_id}:attempts"

    def job_cancelled(self, job_id: str) -> str:
        """Flag set when the client went away; checked by a worker before it starts the job."""
        return f"{self.prefix}:job:{job_id}:cancelled"

    def cancel_channel(self) -> str:
        """Pub/sub channel every worker listens on for running jobs to abort."""
        return f"{self.prefix}:cancel"

    # -- registry ---------------------------------------------------------------------------
    def worker(self, worker_id: str) -> str:
        """One worker's heartbeat record (JSON), expiring after WORKER_HEARTBEAT_TTL_S."""
        return f"{self.prefix}:worker:{worker_id}"

    def model_workers(self, model: str) -> str:
        """Set of worker ids that announced this model (dead ones are pruned by readers)."""
        return f"{self.prefix}:model:{model}:workers"

    def models(self) -> str:
        """Hash model id → JSON card (last seen, context length) of every model ever served."""
        return f"{self.prefix}:models"
