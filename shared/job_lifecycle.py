"""The one owner of a job's life: its states, and every transition between them.

A job is a Redis hash (``RedisKeys.job``) plus its event log and live channel::

    queued ──claim──▶ running ──append(final)──▶ finished | failed
      ▲                  │
      └────requeue───────┘   (its owner died, or handed it back while stopping)
    queued | running ──end──▶ failed | cancelled | expired   (decided by an API process)

Every transition is one Lua script, so it is atomic. ``claim`` gives the claiming worker a new
**epoch**; every write a worker makes afterwards (``append``, ``requeue``) names that epoch, and
the worker process's instance, and is refused once the job has moved on (taken over, cancelled,
ended), so a paused or restarted worker can never write into a job it no longer owns. The
instance matters after a Redis failover: a promoted replica that never saw a claim hands the job
out again under the same epoch number, and only the new claimer's writes may land. An ending
transition always appends the job's final event (``end`` or ``error``) to its log in the same
step: a reader that sees a final state finds the final event, and a stream reader waiting on the
channel receives it.

Events carry sequence numbers; the hash keeps ``next_seq``, and ``append`` accepts only the next
one (earlier ones are duplicates of a retried write and skipped; a later one is a gap the writer
fills from its own copy). The log's entry ids are ``<seq>-1`` so readers can start at any event.

This replaces arq: fencing needs the claim, the owner and the epoch in one record, and arq's
records would have to be rewritten by hand to get that (see docs/design/request-path.md, "Why not arq").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import redis as sync_redis
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from shared import fair_share
from shared.errors import ErrorKind
from shared.events import AnyEvent, ErrorEvent, encode_event
from shared.redis import NO_REPLICA_ACK, ReplicaAck
from shared.redis_keys import (
    HELD_KEYS_MAX,
    HELD_KEYS_TTL_S,
    IMAGE_TTL_S,
    JOB_AUDIO_TTL_S,
    JOB_LOG_MAX_EVENTS,
    JOB_LOG_TTL_S,
    JOB_MAX_ATTEMPTS,
    JOB_RECORD_TTL_S,
    PLACEMENT_BALANCE_SLACK,
    RedisKeys,
)
from shared.redis_replies import as_bytes, log_events, texts


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def is_final(self) -> bool:
        return self not in (JobState.QUEUED, JobState.RUNNING)


# KEYS: job, queue, queue's running set, the tenant's open jobs, the model's workers. ARGV: limit
# (0: none), payload, model, queue, now (ms), score, wake channel, record TTL (s), job id, tenant
# ('' for none), the tenant's limit (0: none; its jobs are counted only when it has one), the
# API's delivery options ('' for none), the job's prefix keys (space-separated, shortest first),
# the placement window (ms; 0: none), the worker records' key prefix, the balance slack (jobs),
# the job's prompt tokens (an estimate, for the queued-prefill gauge), its fair-share tenant
# (``shared.fair_share``), its score in that tenant's queue, its priority band, its key's weight,
# its priority's base score (where it goes back to when handed back). Returns {1, preferred
# worker or ''}, 0 (queue full), -1 (id taken) or -2 (the tenant has its limit of open jobs).
#
# Placement: among the model's live workers that take requests, those that hold the job's longest held key past its
# first message (they claimed a job of that conversation) and are ready with a free slot and no
# more than the balance slack of jobs above the least busy ready worker; the first is preferred
# for the window. None when no live worker holds such a key, or every live worker holds the
# longest one (any of them is as good). A conversation's first message alone places nothing:
# a burst of the same one-message request spreads over the workers as before.
_CREATE = """
local limit = tonumber(ARGV[1])
if limit > 0 and redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3]) >= limit then return 0 end
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local tenant_limit = tonumber(ARGV[11])
local counted = ''
if tenant_limit > 0 then
    -- An entry older than a job record can live was left by a job that never ended: drop it.
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', tonumber(ARGV[5]) - 1000 * tonumber(ARGV[8]))
    if redis.call('ZCARD', KEYS[4]) >= tenant_limit then return -2 end
    redis.call('ZADD', KEYS[4], ARGV[5], ARGV[9])
    redis.call('EXPIRE', KEYS[4], ARGV[8])
    counted = KEYS[4]
end
local preferred = ''
local window_ms = tonumber(ARGV[14])
local wanted = {}
if window_ms > 0 then
    for key in string.gmatch(ARGV[13], '%S+') do wanted[#wanted + 1] = key end
end
if #wanted > 1 then
    local live, least = {}, nil
    for _, worker_id in ipairs(redis.call('SMEMBERS', KEYS[5])) do
        local raw = redis.call('GET', ARGV[15] .. worker_id)
        local info = raw and cjson.decode(raw)
        if info and info['lanes'] ~= 'batch' then
            local jobs = info['num_jobs'] or 0
            local ready = info['state'] == 'ready' and jobs < (info['max_num_seqs'] or 0)
            if ready and (not least or jobs < least) then least = jobs end
            local held = ARGV[15] .. worker_id .. ':' .. (info['instance'] or '') .. ':held'
            live[#live + 1] = {held, worker_id, ready, jobs}
        end
    end
    for _, worker in ipairs(live) do
        worker[3] = worker[3] and worker[4] <= least + tonumber(ARGV[16])
    end
    if #live > 1 then
        for i = #wanted, 2, -1 do
            local holders, free = 0, nil
            for _, worker in ipairs(live) do
                if redis.call('ZSCORE', worker[1], wanted[i]) then
                    holders = holders + 1
                    if worker[3] and not free then free = worker[2] end
                end
            end
            if holders > 0 then
                if holders < #live and free then preferred = free end
                break
            end
        end
    end
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'request', ARGV[2], 'model', ARGV[3], 'queue', ARGV[4],
    'wake', ARGV[7], 'epoch', 0, 'attempts', 0, 'next_seq', 0, 'created_ms', ARGV[5], 'updated_ms', ARGV[5],
    'tenant', ARGV[10], 'tenant_jobs', counted, 'delivery', ARGV[12], 'placement', ARGV[13],
    'preferred', preferred, 'preferred_until', tonumber(ARGV[5]) + window_ms, 'prefill_tokens', ARGV[17],
    'share', ARGV[18], 'band', ARGV[20], 'weight', ARGV[21], 'rank_base', ARGV[22])
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[9])
redis.call('ZADD', KEYS[2] .. ':tenant:' .. ARGV[18], ARGV[19], ARGV[9])
fair_join(KEYS[2], ARGV[18])
redis.call('PUBLISH', ARGV[7], '')
return {1, preferred}
"""

# KEYS: queue, queue's running set, all running jobs. ARGV: job key prefix, worker id, worker
# instance, now (ms), the latest queue score (enqueue time, ms) it may take ('' for any), the
# worker records' key prefix, how many prefix keys a worker holds at most, their TTL (s), the
# placement spills' hash (counted per model when a job placed on another worker is taken), '1'
# to take only a job of a tenant with no job running from the queue (a slot kept for quiet
# keys) or ''. Returns {id, epoch, attempt, next_seq, payload, prefix keys}, {ms} when a job becomes this
# worker's to take in that many ms (too recent, or placed on another worker for a while longer),
# or nil.
#
# Which job (``shared.fair_share``): a job handed back by a dying worker first; then the tenants
# with queued jobs, the one with the least service first (within a priority band), each one's
# jobs by priority, then age; last, jobs an older API queued without a tenant, in queue order.
# A cancelled job met on the way is dropped. A job placed on another worker waits for it until
# its window ends, unless that worker is gone, draining or full (its heartbeat record says). The
# taker holds the job's prefix keys from then on (the most recent ones, for its current process).
_CLAIM = f"""
local queue = KEYS[1]
local latest = tonumber(ARGV[5])
local now = tonumber(ARGV[4])
local ready_in = nil
local function wait_for(ms)
    if not ready_in or ms < ready_in then ready_in = ms end
end

local only_idle = ARGV[10] == '1'
local busy = nil
local function is_busy(share)
    if not busy then
        busy = {{}}
        for _, running in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
            local owner = redis.call('HGET', ARGV[1] .. running, 'share')
            if owner then busy[owner] = true end
        end
    end
    return busy[share] == true
end

local function drop(id, share)
    redis.call('ZREM', queue, id)
    if share then
        redis.call('ZREM', queue .. ':tenant:' .. share, id)
        fair_leave_if_idle(queue, share)
    end
end

-- The job taken by this worker, or nil when it is not this worker's to take (yet).
local function consider(id, share)
    local job = ARGV[1] .. id
    local f = redis.call('HMGET', job, 'state', 'preferred', 'preferred_until', 'placement', 'model', 'share',
        'weight', 'prefill_tokens')
    local enqueued = redis.call('ZSCORE', queue, id)
    if f[1] ~= 'queued' or not enqueued then
        drop(id, f[6] or share)
        return nil
    end
    if only_idle and (not f[6] or is_busy(f[6])) then return nil end
    if latest and tonumber(enqueued) > latest then
        wait_for(tonumber(enqueued) - latest)
        return nil
    end
    if f[2] and f[2] ~= '' and f[2] ~= ARGV[2] and tonumber(f[3]) > now then
        local raw = redis.call('GET', ARGV[6] .. f[2])
        if raw then
            local info = cjson.decode(raw)
            if info['state'] == 'ready' and (info['num_jobs'] or 0) < (info['max_num_seqs'] or 0) then
                wait_for(tonumber(f[3]) - now)
                return nil
            end
        end
    end
    redis.call('ZREM', queue, id)
    if f[2] and f[2] ~= '' and f[2] ~= ARGV[2] then redis.call('HINCRBY', ARGV[9], f[5] or '', 1) end
    local epoch = redis.call('HINCRBY', job, 'epoch', 1)
    local attempt = redis.call('HINCRBY', job, 'attempts', 1)
    redis.call('HSET', job, 'state', 'running', 'owner', ARGV[2], 'owner_instance', ARGV[3], 'updated_ms', ARGV[4])
    redis.call('ZADD', KEYS[2], ARGV[4], id)
    redis.call('ZADD', KEYS[3], ARGV[4], id)
    if f[4] and f[4] ~= '' then
        local held = ARGV[6] .. ARGV[2] .. ':' .. ARGV[3] .. ':held'
        for key in string.gmatch(f[4], '%S+') do redis.call('ZADD', held, now, key) end
        redis.call('ZREMRANGEBYRANK', held, 0, -tonumber(ARGV[7]) - 1)
        redis.call('EXPIRE', held, ARGV[8])
    end
    if f[6] then fair_take(queue, f[6], id, tonumber(f[8] or '0'), tonumber(f[7] or '1'), attempt) end
    local fields = redis.call('HMGET', job, 'next_seq', 'request')
    return {{id, epoch, attempt, fields[1], fields[2], f[4] or ''}}
end

for _, id in ipairs(redis.call('ZRANGEBYSCORE', queue, '-inf', 0, 'LIMIT', 0, 64)) do
    local taken = consider(id, nil)
    if taken then return taken end
end

local tenants = redis.call('ZRANGE', queue .. ':backlog', 0, {fair_share.CLAIM_TENANTS_SCANNED - 1}, 'WITHSCORES')
local order = {{}}
for i = 1, #tenants, 2 do
    local head = redis.call('ZRANGE', queue .. ':tenant:' .. tenants[i], 0, 0, 'WITHSCORES')
    if #head == 0 then
        redis.call('ZREM', queue .. ':backlog', tenants[i])
    else
        local band = tonumber(redis.call('HGET', ARGV[1] .. head[1], 'band') or '0')
        order[#order + 1] = {{tenants[i], tonumber(tenants[i + 1]), band, tonumber(head[2])}}
    end
end
table.sort(order, function(a, b)
    if a[3] ~= b[3] then return a[3] < b[3] end
    if a[2] ~= b[2] then return a[2] < b[2] end
    if a[4] ~= b[4] then return a[4] < b[4] end
    return a[1] < b[1]
end)
for _, tenant in ipairs(order) do
    if not (only_idle and is_busy(tenant[1])) then
        local first = redis.call('ZRANGE', queue .. ':tenant:' .. tenant[1], 0, {fair_share.CLAIM_JOBS_PER_TENANT - 1})
        for _, id in ipairs(first) do
            local taken = consider(id, tenant[1])
            if taken then return taken end
        end
    end
end

local head = only_idle and {{}} or redis.call('ZRANGE', queue, 0, 63, 'WITHSCORES')
for i = 1, #head, 2 do
    if latest and tonumber(head[i + 1]) > latest then
        wait_for(tonumber(head[i + 1]) - latest)
        break
    end
    if redis.call('HEXISTS', ARGV[1] .. head[i], 'share') == 0 then
        local taken = consider(head[i], nil)
        if taken then return taken end
    end
end
if ready_in then return {{ready_in}} end
return false
"""

# KEYS: a worker's held prefix keys. ARGV: key/claim time (ms) pairs. Each key leaves the set
# unless a claim later than that time recorded it again.
_RELEASE_KEYS = """
for i = 1, #ARGV, 2 do
    local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
    if score and tonumber(score) <= tonumber(ARGV[i + 1]) then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return 1
"""

# KEYS: job, log, channel, all running jobs. ARGV: epoch, final state ('' if not final), log TTL
# (s), job id, now (ms), max log length, output tokens the events carry (charged to the job's
# tenant), the writer's instance ('' for any), then seq/payload pairs. Returns {1, next_seq}
# (written), {0, -1} (refused: not this claim's any more) or {2, next_seq} (a gap: resend from
# next_seq).
_APPEND = f"""
local f = redis.call(
    'HMGET', KEYS[1], 'state', 'epoch', 'next_seq', 'queue', 'tenant_jobs', 'share', 'weight', 'owner_instance')
if f[1] ~= 'running' or f[2] ~= ARGV[1] or (ARGV[8] ~= '' and f[8] ~= ARGV[8]) then return {{0, -1}} end
if f[6] then fair_charge(f[4], f[6], tonumber(ARGV[7]), {fair_share.OUTPUT_TOKEN_COST}, tonumber(f[7] or '1')) end
local next_seq = tonumber(f[3])
for i = 9, #ARGV, 2 do
    local seq = tonumber(ARGV[i])
    if seq > next_seq then
        redis.call('HSET', KEYS[1], 'next_seq', next_seq)
        return {{2, next_seq}}
    end
    if seq == next_seq then
        redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], seq .. '-1', 'e', ARGV[i + 1])
        redis.call('PUBLISH', KEYS[3], ARGV[i + 1])
        next_seq = seq + 1
    end
end
redis.call('HSET', KEYS[1], 'next_seq', next_seq, 'updated_ms', ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[3])
if ARGV[2] ~= '' then
    redis.call('HSET', KEYS[1], 'state', ARGV[2])
    redis.call('ZREM', KEYS[4], ARGV[4])
    redis.call('ZREM', f[4] .. ':running', ARGV[4])
    if f[5] and f[5] ~= '' then redis.call('ZREM', f[5], ARGV[4]) end
end
return {{1, next_seq}}
"""

# KEYS: job, all running jobs. ARGV: epoch, job id, now (ms), the owner's instance ('' for any).
# A running job goes back to the front of its queue (its client is waiting). Returns 1, or 0 when
# the claim is not current.
_REQUEUE = """
local f = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'queue', 'wake', 'share', 'rank_base', 'owner_instance')
if f[1] ~= 'running' or f[2] ~= ARGV[1] or (ARGV[4] ~= '' and f[7] ~= ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'updated_ms', ARGV[3])
-- Its placement is over: whichever worker asks first continues it.
redis.call('HDEL', KEYS[1], 'owner', 'owner_instance', 'preferred')
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('ZREM', f[3] .. ':running', ARGV[2])
redis.call('ZADD', f[3], 0, ARGV[2])
if f[5] then
    redis.call('ZADD', f[3] .. ':tenant:' .. f[5], f[6] or 0, ARGV[2])
    fair_join(f[3], f[5])
end
redis.call('PUBLISH', f[4], '')
return 1
"""

# KEYS: job, log, channel, all running jobs. ARGV: final state, expected next_seq, final event,
# log TTL (s), job id, now (ms), expected epoch ('' for any). Ends a queued or running job with
# the given event. Returns 1, 0 (already ended, or another epoch by now), 2 (an event arrived
# meanwhile: read next_seq again) or -1 (no such job).
_END = """
local f = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'next_seq', 'queue', 'tenant_jobs', 'share')
if not f[1] then return -1 end
if f[1] ~= 'queued' and f[1] ~= 'running' then return 0 end
if ARGV[7] ~= '' and f[2] ~= ARGV[7] then return 0 end
if f[3] ~= ARGV[2] then return 2 end
redis.call('XADD', KEYS[2], ARGV[2] .. '-1', 'e', ARGV[3])
redis.call('PUBLISH', KEYS[3], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'next_seq', tonumber(ARGV[2]) + 1, 'updated_ms', ARGV[6])
redis.call('ZREM', f[4], ARGV[5])
redis.call('ZREM', f[4] .. ':running', ARGV[5])
redis.call('ZREM', KEYS[4], ARGV[5])
if f[5] and f[5] ~= '' then redis.call('ZREM', f[5], ARGV[5]) end
if f[6] then
    redis.call('ZREM', f[4] .. ':tenant:' .. f[6], ARGV[5])
    fair_leave_if_idle(f[4], f[6])
end
return 1
"""

_FIELDS = (
    "state", "model", "queue", "epoch", "attempts", "next_seq", "owner", "owner_instance", "tenant", "updated_ms",
)  # fmt: skip
_END_RETRIES = 8
# What a job stopped on purpose reports to whoever reads its log.
_STOP_KINDS = {JobState.CANCELLED: ErrorKind.CANCELLED, JobState.EXPIRED: ErrorKind.EXPIRED}


def _script(text: str, keys: RedisKeys) -> str:
    """A script as the deployment's channels need it (on shard channels, a Redis Cluster's, it
    publishes with SPUBLISH), after the fair share's functions."""
    return fair_share.LUA_FUNCTIONS + text.replace("redis.call('PUBLISH'", f"redis.call('{keys.publish_command}'")


def _writing_keys(keys: RedisKeys, job_id: str) -> list[str]:
    """The keys of the scripts that write events: the job, its log, its channel, the running set."""
    return [keys.job(job_id), keys.job_event_log(job_id), keys.job_events_channel(job_id), keys.running_jobs()]


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class StoredJob:
    payload: bytes  # what the job's worker reads (the contract's encoding)
    delivery: bytes | None  # the API's; None for a job whose API kept it inside the payload


@dataclass(frozen=True)
class JobRecord:
    """A snapshot of a job's hash (without its request payload)."""

    job_id: str
    state: JobState
    model: str
    queue: str
    epoch: int
    attempts: int
    next_seq: int
    owner: str | None
    owner_instance: str | None
    tenant: str | None = None  # the keyed hash of the API key that created it; None without keys
    # Its last transition or write; for a queued job, when it entered its queue (created or requeued).
    updated_ms: int = 0

    @classmethod
    def parse(cls, job_id: str, values: list[bytes | None]) -> JobRecord | None:
        if values[0] is None:
            return None
        text = [value.decode() if value is not None else None for value in values]
        return cls(
            job_id=job_id,
            state=JobState(values[0].decode()),
            model=text[1] or "",
            queue=text[2] or "",
            epoch=int(text[3] or 0),
            attempts=int(text[4] or 0),
            next_seq=int(text[5] or 0),
            owner=text[6],
            owner_instance=text[7],
            tenant=text[8] or None,
            updated_ms=int(text[9] or 0),
        )


@dataclass(frozen=True)
class Claim:
    """A job a worker now owns, under ``epoch``; ``attempt`` > 1 continues an earlier attempt."""

    job_id: str
    epoch: int
    attempt: int
    next_seq: int
    payload: bytes
    prefix_keys: tuple[str, ...] = ()  # its placement keys, now in the claimer's held set
    claimed_ms: int = 0  # their score there
    instance: str = ""  # the claiming worker process: with the epoch, what its writes are fenced by


@dataclass(frozen=True)
class NotYet:
    """The queue's first job has not waited the claimer's ``min_wait_s``: ask again in ``ready_in_s``."""

    ready_in_s: float


class AppendStatus(StrEnum):
    WRITTEN = "written"
    REFUSED = "refused"  # the job is not this epoch's any more: stop working on it
    GAP = "gap"  # the log lost events (a Redis restart): resend from ``next_seq``


@dataclass(frozen=True)
class AppendReply:
    status: AppendStatus
    next_seq: int


@dataclass(frozen=True)
class ShareOf:
    """Whose share of its queue a job is served from (``shared.fair_share``)."""

    tenant: str = ""  # the keyed hash of its API key; '' for the one tenant without keys
    priority: int = 0  # the client's: lower is sooner, among its tenant's jobs
    band: int = 0  # the priority that ranks it across tenants: 0 unless its key may
    weight: float = 1.0  # its key's weight: a tenant of weight 3 gets 3 times the share of one of 1


class JobQueueFull(Exception):
    """The model's queue holds its limit of queued and running jobs."""


class TenantJobsFull(Exception):
    """The API key that asks has its limit of queued and running jobs."""


class JobLifecycle:
    """Every transition of a job, for the API, the batch runner and workers (asyncio side)."""

    def __init__(self, redis: Redis, keys: RedisKeys, replica_ack: ReplicaAck = NO_REPLICA_ACK) -> None:
        """``replica_ack``: how long creating a job waits for a replica to have it."""
        self._redis = redis
        self._keys = self.keys = keys
        self._replica_ack = replica_ack
        self._create = redis.register_script(_script(_CREATE, keys))
        self._claim = redis.register_script(_script(_CLAIM, keys))
        self._requeue = redis.register_script(_script(_REQUEUE, keys))
        self._end = redis.register_script(_script(_END, keys))
        self._release_keys = redis.register_script(_RELEASE_KEYS)

    async def create(
        self,
        job_id: str,
        payload: bytes,
        model: str,
        queue: str,
        limit: int = 0,
        tenant: str | None = None,
        tenant_limit: int = 0,
        delivery: bytes = b"",
        prefix_keys: Sequence[str] = (),
        placement_window_s: float = 0.0,
        prefill_tokens: int = 0,
        share: ShareOf | None = None,
    ) -> str | None:
        """A new queued job; raises JobQueueFull past ``limit`` queued and running jobs in its
        queue, TenantJobsFull past ``tenant_limit`` of the tenant's (0: no limit). ``payload`` is
        what its worker reads; ``delivery``, how the API renders its events, is kept beside it and
        read by API processes alone. ``prefix_keys`` (``shared.placement``): the job waits up to
        ``placement_window_s`` for the live worker that holds the longest of them; returns that
        worker's id, None if the job is any worker's. ``prefill_tokens``: its prompt's size (an
        estimate), what ``queued_prefill_tokens`` adds up. ``share``: whose share of the queue it
        is served from, and in what order (``shared.fair_share``); the shared tenant's without."""
        keys, now = self._keys, now_ms()
        share = share or ShareOf()
        replies = await self._replica_ack.write(
            self._redis,
            f"job {job_id}",
            lambda pipe: self._create(
                keys=[
                    keys.job(job_id), queue, keys.queue_running(queue), keys.tenant_jobs(tenant or ""),
                    keys.model_workers(model),
                ],
                args=[
                    limit, payload, model, queue, now, now, keys.queue_wake_channel(model), JOB_RECORD_TTL_S, job_id,
                    tenant or "", tenant_limit if tenant else 0, delivery, " ".join(prefix_keys),
                    round(placement_window_s * 1000), keys.worker(""), PLACEMENT_BALANCE_SLACK, prefill_tokens,
                    share.tenant, fair_share.tenant_queue_score(share.priority, now), share.band, repr(share.weight),
                    fair_share.priority_base(share.priority),
                ],
                client=pipe,
            ),
        )  # fmt: skip
        created = replies[0]
        if isinstance(created, list):
            preferred = created[1]
            return (preferred.decode() if isinstance(preferred, bytes) else str(preferred)) or None
        if created == 0:
            raise JobQueueFull(model)
        if created == -1:
            raise ValueError(f"job id {job_id} is taken")
        if created == -2:
            raise TenantJobsFull(tenant)
        raise ValueError(f"unexpected reply {created!r} creating job {job_id}")

    async def claim(
        self, queue: str, worker_id: str, instance: str, min_wait_s: float = 0.0, only_idle_tenants: bool = False
    ) -> Claim | NotYet | None:
        """The queue's first job that is this worker's to take, now this worker's; with
        ``min_wait_s``, only one that has waited that long (a job handed back waits at the front
        and is always old enough). A job placed on another worker is left to it for its window.
        ``only_idle_tenants``: only a job of a tenant with no job running from ``queue``."""
        keys, now = self._keys, now_ms()
        latest = str(now - round(min_wait_s * 1000)) if min_wait_s > 0 else ""
        reply = await self._claim(
            keys=[queue, keys.queue_running(queue), keys.running_jobs()],
            args=[
                keys.job_prefix, worker_id, instance, now, latest, keys.worker(""), HELD_KEYS_MAX, HELD_KEYS_TTL_S,
                keys.placement_spills(), "1" if only_idle_tenants else "",
            ],
        )  # fmt: skip
        if not reply:
            return None
        if len(reply) == 1:
            return NotYet(ready_in_s=max(0.0, float(reply[0]) / 1000))
        job_id, epoch, attempt, next_seq, payload, placement = reply
        prefix_keys = tuple(as_bytes(placement).decode().split())
        return Claim(
            job_id.decode(), int(epoch), int(attempt), int(next_seq), bytes(payload), prefix_keys, now, instance
        )

    async def release_prefix_keys(self, worker_id: str, instance: str, released: Sequence[tuple[str, int]]) -> None:
        """The worker process holds these prefix keys no more (its prefix cache let their prompts
        go), each unless a claim later than its time (ms) recorded it again."""
        args = [part for key, claimed_ms in released for part in (key, claimed_ms)]
        if args:
            await self._release_keys(keys=[self._keys.worker_held_keys(worker_id, instance)], args=args)

    async def record(self, job_id: str) -> JobRecord | None:
        return (await self.records([job_id]))[job_id]

    async def records(self, job_ids: list[str]) -> dict[str, JobRecord | None]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self._keys.job(job_id), _FIELDS)
            replies = await pipe.execute()
        return {job_id: JobRecord.parse(job_id, values) for job_id, values in zip(job_ids, replies, strict=True)}

    async def running_records(self, queues: list[str]) -> list[JobRecord]:
        """The jobs claimed from ``queues`` and not yet ended."""
        job_ids: list[str] = []
        for queue in queues:
            job_ids += [
                as_bytes(raw).decode() for raw in await self._redis.zrange(self._keys.queue_running(queue), 0, -1)
            ]
        return [record for record in (await self.records(job_ids)).values() if record is not None]

    async def stored(self, job_id: str) -> StoredJob | None:
        """The job's request payload and the API's delivery options, as created."""
        raw, delivery = await self._redis.hmget(self._keys.job(job_id), ["request", "delivery"])
        if raw is None:
            return None
        return StoredJob(as_bytes(raw), as_bytes(delivery) if delivery else None)

    async def running_job_ids(self) -> list[str]:
        return texts(await self._redis.zrange(self._keys.running_jobs(), 0, -1))

    async def placement_spills(self) -> dict[str, int]:
        """Model → jobs taken by a worker other than the one they were placed on."""
        raw = await self._redis.hgetall(self._keys.placement_spills())
        return {as_bytes(model).decode(): int(count) for model, count in raw.items()}

    async def queued_prefill_tokens(self, queue: str, sample: int = 1000) -> int:
        """The prompt tokens waiting in ``queue`` (as their APIs estimated them): its first
        ``sample`` jobs', scaled to its length (a scrape reads a bounded number of jobs)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zcard(queue)
            pipe.zrange(queue, 0, sample - 1)
            length, head = await pipe.execute()
        if not head:
            return 0
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in texts(head):
                pipe.hget(self._keys.job(job_id), "prefill_tokens")
            sizes = [int(size or 0) for size in await pipe.execute()]
        return round(sum(sizes) * int(length) / len(sizes))

    async def shares(self, queue: str) -> list[fair_share.TenantShare]:
        """Each tenant's place in ``queue``'s fair share."""
        return await fair_share.read_shares(self._redis, queue)

    async def running_tenants(self, queue: str) -> list[str]:
        """The fair-share tenant of each job claimed from ``queue`` and still running."""
        job_ids = texts(await self._redis.zrange(self._keys.queue_running(queue), 0, -1))
        return await fair_share.tenants_of(self._redis, [self._keys.job(job_id) for job_id in job_ids])

    async def queued_job_ids(self, queue: str) -> list[str]:
        """The jobs waiting in ``queue``, first to be claimed first."""
        return texts(await self._redis.zrange(queue, 0, -1))

    async def read_log(self, job_id: str, from_seq: int = 0) -> list[AnyEvent]:
        """The job's events from ``from_seq`` on, in order."""
        entries = await self._redis.xrange(self._keys.job_event_log(job_id), min=f"{max(from_seq, 0)}-1")
        return log_events(entries)

    async def requeue(self, job_id: str, epoch: int, instance: str = "") -> bool:
        """Back to the front of its queue: its owner (of ``epoch``, and of ``instance`` if named)
        died or handed it back."""
        replied = await self._requeue(
            keys=[self._keys.job(job_id), self._keys.running_jobs()], args=[epoch, job_id, now_ms(), instance]
        )
        return bool(replied)

    async def reclaim(self, record: JobRecord) -> JobState | None:
        """A running job whose owner is gone: requeued, or failed after ``JOB_MAX_ATTEMPTS``.
        None when the job moved on meanwhile (another process got there first)."""
        if record.attempts >= JOB_MAX_ATTEMPTS:
            message = f"job {record.job_id} lost its worker {record.attempts} times; giving up"
            ended = await self.end(record.job_id, JobState.FAILED, ErrorKind.WORKER_LOST, message, record.epoch)
            return JobState.FAILED if ended else None
        return JobState.QUEUED if await self.requeue(record.job_id, record.epoch, record.owner_instance or "") else None

    async def end(
        self,
        job_id: str,
        state: JobState,
        kind: ErrorKind,
        message: str,
        epoch: int | None = None,
        param: str | None = None,
    ) -> bool:
        """End a queued or running job (of ``epoch``, if given) with an error event: failed,
        cancelled or expired. False when it had already ended (or moved to another epoch)."""
        keys = self._keys
        for _ in range(_END_RETRIES):
            record = await self.record(job_id)
            if record is None or record.state.is_final:
                return False
            event = encode_event(ErrorEvent(seq=record.next_seq, kind=kind, message=message, param=param))
            replied = await self._end(
                keys=_writing_keys(keys, job_id),
                args=[
                    state.value, record.next_seq, event, JOB_LOG_TTL_S, job_id, now_ms(),
                    "" if epoch is None else epoch,
                ],
            )  # fmt: skip
            if replied != 2:
                return bool(replied == 1)
        return False

    async def cancel(
        self, job_ids: list[str], message: str = "cancelled by the client", state: JobState = JobState.CANCELLED
    ) -> None:
        """Stop queued and running jobs that nobody wants any more: ``CANCELLED`` (a client or a
        batch cancel) or ``EXPIRED`` (their batch's window closed). Their workers learn it at once
        from the cancel channel, so they free the capacity now rather than at their next write."""
        kind = _STOP_KINDS[state]
        for job_id in job_ids:
            await self.end(job_id, state, kind, message)
        if job_ids:
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in job_ids:
                    pipe.execute_command(self._keys.publish_command, self._keys.cancel_channel(), job_id.encode())
                await pipe.execute()

    async def track_background(self, job_id: str) -> None:
        """A background job: API processes collect its result once it ends."""
        await self._redis.sadd(self._keys.background_jobs(), job_id)

    async def background_job_ids(self) -> list[str]:
        """The background jobs whose result is not kept yet, in id order."""
        return sorted(texts(await self._redis.smembers(self._keys.background_jobs())))

    async def untrack_background(self, job_id: str, result: str, retention_s: int) -> None:
        """Keep a background job's ``result`` (JSON) for ``retention_s`` and stop collecting it,
        in one transaction: a result is never dropped from the set before it is stored."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self._keys.ended_job(job_id), result, ex=retention_s)
            pipe.srem(self._keys.background_jobs(), job_id)
            await pipe.execute()

    async def store_audio(self, samples: dict[str, bytes]) -> None:
        """Each transcription window's samples by job id, before its job is created."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id, pcm in samples.items():
                pipe.set(self._keys.job_audio(job_id), pcm, ex=JOB_AUDIO_TTL_S)
            await pipe.execute()

    async def read_audio(self, job_id: str) -> bytes | None:
        """A transcription window's samples; None once they expired or were dropped."""
        pcm = await self._redis.get(self._keys.job_audio(job_id))
        return pcm if isinstance(pcm, bytes) else None

    async def drop_audio(self, job_ids: list[str]) -> None:
        if job_ids:
            await self._redis.delete(*(self._keys.job_audio(job_id) for job_id in job_ids))

    async def store_images(self, images: dict[str, bytes]) -> None:
        """Images by SHA-256, before the job naming them is created (a stored one's TTL restarts)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for sha256, data in images.items():
                pipe.set(self._keys.image(sha256), data, ex=IMAGE_TTL_S)
            await pipe.execute()

    async def read_image(self, sha256: str) -> bytes | None:
        """An image's bytes; None once they expired."""
        data = await self._redis.get(self._keys.image(sha256))
        return data if isinstance(data, bytes) else None

    async def delete(self, job_id: str) -> None:
        """Forget an ended job (its record and log)."""
        await self._redis.delete(self._keys.job(job_id), self._keys.job_event_log(job_id))


@dataclass(frozen=True)
class AppendRequest:
    """Events of one job from one engine step (each already encoded with its seq)."""

    job_id: str
    epoch: int
    events: list[tuple[int, bytes]]
    final_state: JobState | None
    num_tokens: int = 0  # output tokens the events carry (charged to the job's tenant)
    instance: str = ""  # the claiming worker process ('' writes under the epoch alone)


class EventAppender:
    """``append`` for a worker's engine thread, on a synchronous client: one pipelined round
    trip per engine step, whatever the number of jobs in it.

    It sends EVALSHA itself: a registered script in a pipeline costs a SCRIPT EXISTS round trip
    on every execute, a second round trip per step on the engine thread."""

    def __init__(self, redis: sync_redis.Redis, keys: RedisKeys) -> None:
        self._redis = redis
        self._keys = keys
        self._text = _script(_APPEND, keys)
        self._sha: str = redis.register_script(self._text).sha  # loaded into Redis on the first NOSCRIPT

    def append(self, requests: list[AppendRequest]) -> list[AppendReply]:
        """Raises RedisError when Redis cannot be reached (nothing, some or all were written)."""
        try:
            replies = self._send(requests)
        except NoScriptError:
            # First use, or Redis restarted with an empty script cache: every call in the pipeline
            # failed alike, and resending is safe (the script skips events the log already has).
            self._sha = self._redis.script_load(self._text)
            replies = self._send(requests)
        return [_append_reply(reply) for reply in replies]

    def _send(self, requests: list[AppendRequest]) -> list[list[int]]:
        keys, now = self._keys, now_ms()
        pipe = self._redis.pipeline(transaction=False)
        for request in requests:
            job_id = request.job_id
            final = request.final_state.value if request.final_state is not None else ""
            args: list[str | int | bytes] = [
                request.epoch, final, JOB_LOG_TTL_S, job_id, now, JOB_LOG_MAX_EVENTS, request.num_tokens,
                request.instance,
            ]  # fmt: skip
            for seq, payload in request.events:
                args += [seq, payload]
            pipe.evalsha(self._sha, 4, *_writing_keys(keys, job_id), *args)
        replies: list[list[int]] = pipe.execute()
        return replies


def _append_reply(reply: list[int]) -> AppendReply:
    code, next_seq = int(reply[0]), int(reply[1])
    status = {1: AppendStatus.WRITTEN, 0: AppendStatus.REFUSED, 2: AppendStatus.GAP}[code]
    return AppendReply(status, next_seq)
