"""Every Redis key and channel relaylm uses, built in one place, each with its TTL beside it.

Everything lives under one configurable prefix so that several deployments can share a Redis.
In a Redis Cluster the prefix is a hash tag, ``{relaylm}``: every key and channel of a deployment
hashes to one slot, so each script, transaction and pipeline stays on the one primary serving it,
and its channels are shard channels (``SPUBLISH``/``SSUBSCRIBE``), which the cluster delivers on
that shard alone. The job keys are read and written only through :mod:`shared.job_lifecycle`.
"""

from __future__ import annotations

from dataclasses import dataclass

# A job's record (state, owner, epoch, request payload) outlives any reasonable generation.
JOB_RECORD_TTL_S = 24 * 3600
# A job's event log (for gaps, reconnects and resuming on another worker) outlives its last event by this.
JOB_LOG_TTL_S = 3600
JOB_LOG_MAX_EVENTS = 200_000
# A transcription window's samples outlive their job's longest reasonable wait and run by this;
# the API deletes them as soon as it has the window's text.
JOB_AUDIO_TTL_S = 3600
# An image a job names outlives its job's longest reasonable wait and run by this, as audio does
# (sent again, its TTL restarts); a job whose images expired before a worker took it fails.
IMAGE_TTL_S = 3600
# A job is started at most this many times (the first worker, then takeovers after a worker dies).
JOB_MAX_ATTEMPTS = 3
# A worker holds the prefix keys (``shared.placement``) of the jobs it claimed, while it runs them
# and then while its prefix cache holds their prompts: this many at most, the most recent, while
# its process lives (its held set expires this long after its last claim).
HELD_KEYS_MAX = 4096
HELD_KEYS_TTL_S = 24 * 3600
# A job is placed on the worker that holds its conversation only while that worker runs at most
# this many jobs more than the least busy ready worker of its model (a prefill saved is worth a
# slightly larger batch, not a queue behind one worker).
PLACEMENT_BALANCE_SLACK = 4
# A worker that misses heartbeats for this long is considered dead.
WORKER_HEARTBEAT_TTL_S = 5
# A model no worker has served for this long is forgotten (404 instead of 503).
MODEL_FORGET_AFTER_S = 24 * 3600


@dataclass(frozen=True)
class RedisKeys:
    """Key builder bound to one deployment prefix."""

    prefix: str = "relaylm"
    sharded_channels: bool = False  # channels are shard channels (Redis Cluster)

    @classmethod
    def in_cluster(cls, prefix: str) -> RedisKeys:
        """The keys of a deployment on a Redis Cluster: one hash tag, shard channels."""
        return cls(f"{{{prefix}}}", sharded_channels=True)

    @property
    def publish_command(self) -> str:
        """The command that publishes on this deployment's channels."""
        return "SPUBLISH" if self.sharded_channels else "PUBLISH"

    # -- queues -----------------------------------------------------------------------------
    def queue(self, model: str) -> str:
        """Sorted set of one model's queued interactive job ids (score: enqueue time, 0 for a
        job taken over from a dead worker): workers only take their model's jobs."""
        return f"{self.prefix}:queue:{model}"

    def batch_queue(self, model: str) -> str:
        """Sorted set of one model's queued batch lines: workers take them only with capacity to spare."""
        return f"{self.prefix}:queue:{model}:batch"

    @staticmethod
    def queue_running(queue: str) -> str:
        """Sorted set of the jobs claimed from ``queue`` and not yet ended (for the queue limit)."""
        return f"{queue}:running"

    def queue_wake_channel(self, model: str) -> str:
        """Pub/sub channel pinged after an enqueue, so idle workers claim at once."""
        return f"{self.prefix}:queue:{model}:wake"

    def placement_spills(self) -> str:
        """Hash model → jobs claimed by a worker other than the one they were placed on (the
        window ended, or that worker could not take them), since Redis last lost its data."""
        return f"{self.prefix}:placement:spilled"

    def running_jobs(self) -> str:
        """Sorted set of every running job (score: claim time): API processes watch their owners."""
        return f"{self.prefix}:jobs:running"

    def replica_ack(self) -> str:
        """Prefix of the throw-away markers (``<this>:<token>``, expiring after a minute) that a
        ``WAIT`` for a replica follows (see shared.redis.ReplicaAck)."""
        return f"{self.prefix}:replica-ack"

    def owner_hash_secret(self) -> str:
        """The HMAC key API processes share to name a key's owner, when no --owner-hash-secret is set."""
        return f"{self.prefix}:owner-hash-secret"

    def stored_response(self, response_id: str) -> str:
        """A stored Responses API response (JSON: the Response, its input items, the conversation
        so far and its owner), expiring after --result-retention-s."""
        return f"{self.prefix}:response:{response_id}"

    def tenant_jobs(self, tenant: str) -> str:
        """Sorted set of a tenant's queued and running jobs (score: creation time), kept only when
        a per-key limit is set; expires JOB_RECORD_TTL_S after its last job was created."""
        return f"{self.prefix}:tenant:{tenant}:jobs"

    # -- jobs -------------------------------------------------------------------------------
    @property
    def job_prefix(self) -> str:
        """``job(id)`` is this plus the id; the claim script builds job keys from queue members with it."""
        return f"{self.prefix}:job:"

    def job(self, job_id: str) -> str:
        """Hash: the job's state, owner and epoch, attempts, next event number and request payload."""
        return f"{self.job_prefix}{job_id}"

    def job_audio(self, job_id: str) -> str:
        """String: a transcription window's samples (16 kHz mono int16 PCM), expiring after
        JOB_AUDIO_TTL_S."""
        return f"{self.job_prefix}{job_id}:audio"

    def image(self, sha256: str) -> str:
        """String: an image's bytes as the API validated them, named by their SHA-256 (jobs name
        images, so one image sent in many requests is stored once), expiring after IMAGE_TTL_S."""
        return f"{self.prefix}:image:{sha256}"

    def job_events_channel(self, job_id: str) -> str:
        """Pub/sub channel carrying the job's event stream to the API."""
        return f"{self.prefix}:job:{job_id}:events"

    def job_event_log(self, job_id: str) -> str:
        """Redis Stream with every event of the job (entry id ``<seq>-1``), beside the live channel."""
        return f"{self.prefix}:job:{job_id}:log"

    def api_channel(self, instance: str) -> str:
        """Pub/sub channel of one API process's own, which keeps its event subscription open."""
        return f"{self.prefix}:api:{instance}"

    def cancel_channel(self) -> str:
        """Pub/sub channel every worker listens on for running jobs to abort."""
        return f"{self.prefix}:cancel"

    def ended_job(self, job_id: str) -> str:
        """An ended background job's result (JSON: the job, how it ended and its events), kept
        for the retention period."""
        return f"{self.prefix}:job:{job_id}:ended"

    def background_jobs(self) -> str:
        """Set of background job ids still running: API processes collect their results."""
        return f"{self.prefix}:background"

    # -- files and batches ----------------------------------------------------------------------
    def file_meta(self, file_id: str) -> str:
        """A file's FileObject (JSON), expiring with the file."""
        return f"{self.prefix}:file:{file_id}:meta"

    def file_content(self, file_id: str) -> str:
        """A file's bytes, expiring with the file."""
        return f"{self.prefix}:file:{file_id}:content"

    def files(self) -> str:
        """Sorted set of file ids by creation time (expired ones are pruned by readers)."""
        return f"{self.prefix}:files"

    def batch(self, batch_id: str) -> str:
        """A batch's Batch object (JSON): the source of truth for its status and counts."""
        return f"{self.prefix}:batch:{batch_id}"

    def batches(self) -> str:
        """Sorted set of batch ids by creation time."""
        return f"{self.prefix}:batches"

    def active_batches(self) -> str:
        """Set of batches not yet in a final status: API processes advance them."""
        return f"{self.prefix}:batches:active"

    def batch_lock(self, batch_id: str) -> str:
        """Held by the one API process advancing the batch right now."""
        return f"{self.prefix}:batch:{batch_id}:lock"

    def batch_requests(self, batch_id: str) -> str:
        """Hash line number → the line's validated request (JSON)."""
        return f"{self.prefix}:batch:{batch_id}:requests"

    def batch_pending(self, batch_id: str) -> str:
        """List of line numbers not yet enqueued."""
        return f"{self.prefix}:batch:{batch_id}:pending"

    def batch_running(self, batch_id: str) -> str:
        """Hash line number → job id of lines enqueued and not yet collected."""
        return f"{self.prefix}:batch:{batch_id}:running"

    def batch_outputs(self, batch_id: str) -> str:
        """Hash line number → output line (JSON) of lines that succeeded."""
        return f"{self.prefix}:batch:{batch_id}:outputs"

    def batch_errors(self, batch_id: str) -> str:
        """Hash line number → error line (JSON) of lines that failed."""
        return f"{self.prefix}:batch:{batch_id}:errors"

    def batch_keys(self, batch_id: str) -> list[str]:
        """Every key of a batch's working state (expired together once the batch is final)."""
        return [
            self.batch_requests(batch_id), self.batch_pending(batch_id), self.batch_running(batch_id),
            self.batch_outputs(batch_id), self.batch_errors(batch_id),
        ]  # fmt: skip

    # -- registry ---------------------------------------------------------------------------
    def worker(self, worker_id: str) -> str:
        """One worker's heartbeat record (JSON), expiring after WORKER_HEARTBEAT_TTL_S."""
        return f"{self.prefix}:worker:{worker_id}"

    def worker_held_keys(self, worker_id: str, instance: str) -> str:
        """Sorted set: the prefix keys one worker process holds, scored by their latest claim (ms)."""
        return f"{self.worker(worker_id)}:{instance}:held"

    def model_workers(self, model: str) -> str:
        """Set of worker ids that announced this model (dead ones are pruned by readers)."""
        return f"{self.prefix}:model:{model}:workers"

    def models(self) -> str:
        """Hash model id → JSON card (last seen, context length) of every model ever served."""
        return f"{self.prefix}:models"

    def adapters(self) -> str:
        """Hash adapter name → JSON record (``shared.adapters.AdapterRecord``) of every stored LoRA
        adapter; kept until unloaded (no TTL: an adapter is configuration, not a job's data)."""
        return f"{self.prefix}:adapters"

    def adapter_files(self, name: str) -> str:
        """Hash ``config`` / ``weights`` → an adapter's PEFT files as stored, beside its record."""
        return f"{self.prefix}:adapter:{name}"
