"""Riding out Redis not answering, for a stream and for the housekeeper.

With one Redis there is no one to wait for: a stream ends with ``redis_unavailable`` at its first
failed command. Under Sentinel or Cluster a failover names a new primary within the failure
detection plus an election, so a stream waits up to ``--redis-failover-wait-s`` for Redis to
answer again, then reads what it missed from the job's log.

While Redis did not answer, no worker could heartbeat either: a worker's lease
(``WORKER_HEARTBEAT_TTL_S``) may have run out through no fault of its own, and the new primary
may lack a job's last events until its worker writes them again from its copy. So for one lease
after Redis answers again (or after the event subscription moved to a new primary) the new
primary is *settling*: no job is requeued or failed for a missed heartbeat, and a gap its log
cannot fill yet is not an error. After that the usual rules apply, with their grace.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared.redis_keys import WORKER_HEARTBEAT_TTL_S


class RedisOutage:
    def __init__(
        self,
        failover_wait_s: float,
        lease_s: float = WORKER_HEARTBEAT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``failover_wait_s``: how long Redis may not answer before waiting is pointless (0: one
        Redis, no failover to wait for)."""
        self._failover_wait_s = failover_wait_s
        self._lease_s = lease_s
        self._clock = clock
        self._failing_since: float | None = None
        self._settling_until = float("-inf")

    @property
    def is_failing(self) -> bool:
        return self._failing_since is not None

    def failed(self) -> bool:
        """A command failed: whether to wait on (a failover may be under way)."""
        now = self._clock()
        if self._failing_since is None:
            self._failing_since = now
        return now - self._failing_since < self._failover_wait_s

    def answered(self) -> None:
        """A command succeeded: after an outage, the new primary settles for a lease."""
        if self._failing_since is not None:
            self._failing_since = None
            self.moved()

    def moved(self) -> None:
        """The event subscription was renewed, on a new primary or after a lost connection."""
        self._settling_until = self._clock() + self._lease_s

    @property
    def is_settling(self) -> bool:
        """Redis does not answer, or did not for a while: heartbeats and logs may lag behind."""
        return self.is_failing or self._clock() < self._settling_until
