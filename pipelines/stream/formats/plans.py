"""The decoders an event format keeps, per writer schema (``PlanCache``): bounded, so no stream of schema ids or
message indexes can make it grow without end.

A plan is a decoder of one writer schema, or the reason its events are dead letters (a ``str``). Both are kept
in an LRU of at most ``max_plans`` entries (a schema id names one schema for ever, so its decoder or the reason
it has none holds while it is kept); a ``Retry`` reason (an id the registry does not know yet, an error answer)
is kept for ``retry_s`` seconds only, so the next events of that id ask again, at most once per ``retry_s``.
Thread-safe (a DoFn's bundles may share one format).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

__all__ = ["MAX_PLANS", "RETRY_S", "PlanCache", "Retry"]

#: Writer schemas (registry ids, Protobuf message indexes) whose decoders a format keeps.
MAX_PLANS = 256
#: Seconds a reason that may change (an unknown id, a registry error) is kept before the registry is asked again.
RETRY_S = 30.0


class Retry(str):
    """A reason that may not hold for long (the registry may learn the id): kept ``retry_s`` seconds."""


class PlanCache:
    def __init__(self, max_plans: int = MAX_PLANS, retry_s: float = RETRY_S):
        self.max_plans, self.retry_s = max_plans, retry_s
        self._plans: OrderedDict = OrderedDict()  # key -> (plan, expires or None)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key):
        """The plan kept for ``key``, or None (never kept, evicted, or a ``Retry`` past its time)."""
        with self._lock:
            found = self._plans.get(key)
            if found is None:
                return None
            plan, expires = found
            if expires is not None and time.monotonic() >= expires:
                del self._plans[key]
                return None
            self._plans.move_to_end(key)
            return plan

    def put(self, key, plan) -> None:
        expires = time.monotonic() + self.retry_s if isinstance(plan, Retry) else None
        with self._lock:
            self._plans[key] = (plan, expires)
            self._plans.move_to_end(key)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
