"""Fair share between tenants, decided in the claim: a Virtual Token Counter per tenant and queue.

Each queue (a model's interactive lane, or its batch lane) keeps, beside its FIFO sorted set:

- ``<queue>:tenant:<tenant>``: the tenant's queued jobs, scored by client priority, then by
  enqueue time (``tenant_queue_score``);
- ``<queue>:backlog``: the tenants with queued jobs, scored by their service counter;
- ``<queue>:service``: every tenant's counter, idle ones included while they are ahead of the
  floor (below it they are dropped: a returning tenant is lifted to the floor anyway, and one
  whose running jobs are charged again restarts from the floor);
- ``<queue>:fair``: the floor (field ``floor``, the least counter of the backlogged tenants the
  last time a job was taken) and the tokens served per tenant (``served:<tenant>``).

A tenant's counter grows by the service its jobs receive, divided by its key's weight:
``PROMPT_TOKEN_COST`` per prompt token when a job is first taken, ``OUTPUT_TOKEN_COST`` per output
token as its worker writes them (the VTC paper's weights: a decoded token costs a full step, a
prompt token a share of one). The claim serves the backlogged tenant with the least counter, its
job with the lowest priority first, then the oldest. A tenant that returns from idle is lifted to
the least counter of those waiting (or the floor): idle time banks no credit. A job handed back
by a dying worker goes first, before any tenant's (its client is waiting mid-stream).

By default a client's ``priority`` orders only its own tenant's jobs, and breaks ties between
tenants of equal service: a key cannot buy itself above another's share. A key the admin marks
``priority=global`` in the key file has its priority rank first, across tenants (a band), and
the fair share applies within a band.

Every counter lives in Redis next to the queue, so it holds for every worker on every host,
replicates and persists as the job state does; a Redis that lost its data starts everyone level.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from shared.redis_replies import as_bytes, texts

PRIORITY_MIN, PRIORITY_MAX = -1000, 1000
PROMPT_TOKEN_COST = 1
OUTPUT_TOKEN_COST = 2
# A tenant queue's score: (priority - PRIORITY_MIN) * 2^42 + enqueue time (ms), exact in a double
# until the year 2109; a handed-back job scores its priority's base (before every queued one).
_PRIORITY_STEP = 2**42
# Tenants the claim looks at, the least served first; within each, its first jobs.
CLAIM_TENANTS_SCANNED = 64
CLAIM_JOBS_PER_TENANT = 16


def tenant_queue_score(priority: int, enqueued_ms: int) -> int:
    return (priority - PRIORITY_MIN) * _PRIORITY_STEP + enqueued_ms


def priority_base(priority: int) -> int:
    return tenant_queue_score(priority, 0)


# Lua shared by the lifecycle's scripts (prepended to them). ``queue`` is the queue's key; every
# key built from it shares its hash tag, so a Redis Cluster keeps them on the queue's slot.
LUA_FUNCTIONS = f"""
local function fair_join(queue, tenant)
    local backlog = queue .. ':backlog'
    if redis.call('ZSCORE', backlog, tenant) then return end
    local service = queue .. ':service'
    local counter = tonumber(redis.call('ZSCORE', service, tenant) or '0')
    local least = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
    local floor = tonumber(least[2] or redis.call('HGET', queue .. ':fair', 'floor') or '0')
    if counter < floor then counter = floor end
    redis.call('ZADD', service, counter, tenant)
    redis.call('ZADD', backlog, counter, tenant)
end

local function fair_leave_if_idle(queue, tenant)
    if redis.call('EXISTS', queue .. ':tenant:' .. tenant) == 0 then redis.call('ZREM', queue .. ':backlog', tenant) end
end

-- A tenant forgotten below the floor while its jobs ran is charged from the floor (never from 0,
-- which would hand it the credit it had fallen behind by).
local function fair_charge(queue, tenant, tokens, cost, weight)
    if tokens <= 0 then return end
    local service = queue .. ':service'
    if not redis.call('ZSCORE', service, tenant) then
        redis.call('ZADD', service, tonumber(redis.call('HGET', queue .. ':fair', 'floor') or '0'), tenant)
    end
    local counter = redis.call('ZINCRBY', service, tokens * cost / weight, tenant)
    if redis.call('ZSCORE', queue .. ':backlog', tenant) then
        redis.call('ZADD', queue .. ':backlog', counter, tenant)
    end
    redis.call('HINCRBY', queue .. ':fair', 'served:' .. tenant, tokens)
end

-- A job of ``tenant`` is taken: the floor rises to the least backlogged counter, idle tenants
-- below it are forgotten, and the tenant pays for the prompt (once: a retry is not its fault).
local function fair_take(queue, tenant, id, prompt_tokens, weight, attempt)
    redis.call('ZREM', queue .. ':tenant:' .. tenant, id)
    local least = redis.call('ZRANGE', queue .. ':backlog', 0, 0, 'WITHSCORES')
    if least[2] then
        local floor = tonumber(redis.call('HGET', queue .. ':fair', 'floor') or '0')
        if tonumber(least[2]) > floor then
            redis.call('HSET', queue .. ':fair', 'floor', least[2])
            redis.call('ZREMRANGEBYSCORE', queue .. ':service', '-inf', '(' .. least[2])
        end
    end
    if attempt == 1 then fair_charge(queue, tenant, prompt_tokens, {PROMPT_TOKEN_COST}, weight) end
    fair_leave_if_idle(queue, tenant)
end
"""


@dataclass(frozen=True)
class TenantShare:
    """One tenant's place in one queue's fair share, as ``/metrics`` shows it."""

    tenant: str  # the keyed hash of its API key; '' without keys
    queued: int
    served_tokens: int  # prompt and output tokens its jobs were served, since Redis last lost its data
    rank: int | None  # 0: its job is claimed next; None: nothing queued
    lead: float  # its counter above the least served waiting tenant's (weighted tokens)


async def read_shares(redis: Redis, queue: str) -> list[TenantShare]:
    """The tenants of ``queue`` that are waiting or were served (bounded by the configured keys)."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.zrange(f"{queue}:backlog", 0, -1, withscores=True)
        pipe.hgetall(f"{queue}:fair")
        backlog, fair = await pipe.execute()
    waiting = [(as_bytes(tenant).decode(), float(counter)) for tenant, counter in backlog]
    served = {
        as_bytes(field).decode()[len("served:") :]: int(value)
        for field, value in fair.items()
        if as_bytes(field).startswith(b"served:")
    }
    async with redis.pipeline(transaction=False) as pipe:
        for tenant, _ in waiting:
            pipe.zcard(f"{queue}:tenant:{tenant}")
        queued = [int(count) for count in await pipe.execute()] if waiting else []
    least = waiting[0][1] if waiting else 0.0
    shares = {
        tenant: TenantShare(tenant, count, served.get(tenant, 0), rank, counter - least)
        for rank, ((tenant, counter), count) in enumerate(zip(waiting, queued, strict=True))
    }
    for tenant, tokens in served.items():
        shares.setdefault(tenant, TenantShare(tenant, 0, tokens, None, 0.0))
    return sorted(shares.values(), key=lambda share: (share.rank is None, share.rank or 0, share.tenant))


async def tenants_of(redis: Redis, job_keys: list[str]) -> list[str]:
    """The fair-share tenant of each job (by its key); '' for one without."""
    if not job_keys:
        return []
    async with redis.pipeline(transaction=False) as pipe:
        for key in job_keys:
            pipe.hget(key, "share")
        return texts([value or b"" for value in await pipe.execute()])
