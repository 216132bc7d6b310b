"""Moving a job whose worker died to another worker, at once.

arq would re-run it only when the dead worker's in-progress key expires (the job timeout plus
10 s: an hour here), and from token 0. Instead the API that notices the silence re-enqueues the
job under a new arq id, after removing the dead attempt's arq records; the worker that picks it
reads the job's event log and continues from the tokens already sent. The script checks that
the dead worker still owns the job, so two API processes cannot both take it over.
"""

from __future__ import annotations

from arq.constants import expires_extra_ms as arq_expires_extra_ms
from arq.constants import in_progress_key_prefix, job_key_prefix
from arq.jobs import serialize_job
from arq.utils import timestamp_ms
from redis.asyncio import Redis

from shared import serialization
from shared.jobs import CHAT_JOB_FUNCTION
from shared.redis_keys import JOB_MAX_ATTEMPTS, RedisKeys

REQUEUED = "requeued"
# Returns 1 (requeued), 0 (the job has another owner by now) or -1 (out of attempts).
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(redis.call('GET', KEYS[3]) or '0') >= tonumber(ARGV[2]) then return -1 end
local old_arq_id = redis.call('GET', KEYS[4])
if old_arq_id then
    redis.call('DEL', ARGV[9] .. old_arq_id, ARGV[10] .. old_arq_id)
    redis.call('ZREM', KEYS[2], old_arq_id)
end
redis.call('SET', KEYS[1], ARGV[3], 'KEEPTTL')
redis.call('PSETEX', ARGV[10] .. ARGV[4], ARGV[5], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[7], ARGV[4])
redis.call('PUBLISH', ARGV[8], '')
return 1
"""


class JobTakeover:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self._keys = keys
        self._script = redis.register_script(_TAKE_OVER)

    async def requeue(
        self, job_id: str, model: str, dead_worker_id: str, attempt: int, queue: str | None = None
    ) -> int:
        """``queue``: the model's interactive queue unless given (batch lines go back to theirs)."""
        keys = self._keys
        arq_id = f"{job_id}:r{attempt + 1}"
        now_ms = timestamp_ms()
        record = serialize_job(CHAT_JOB_FUNCTION, (job_id,), {}, None, now_ms, serializer=serialization.serialize)
        queue = queue or keys.queue(model)
        outcome = await self._script(
            keys=[keys.job_owner(job_id), queue, keys.job_attempts(job_id), keys.job_arq_id(job_id)],
            args=[
                dead_worker_id, JOB_MAX_ATTEMPTS, REQUEUED, arq_id, arq_expires_extra_ms, record,
                # a taken-over job goes to the front of the queue: its client is already waiting
                1, keys.queue_wake_channel(model), in_progress_key_prefix, job_key_prefix,
            ],
        )  # fmt: skip
        return int(outcome)
