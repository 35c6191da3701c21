"""The engine's waiting queue: priority first, then fair shares of tokens across tenants.

Inside one priority class the queue is start-time fair queueing on tokens (a weighted fair
queueing variant that needs no knowledge of the flows in advance): a request's cost is the tokens
it asks for (prompt + max_new_tokens); it gets the virtual start max(V, the finish tag of its
tenant's previous request) and the finish tag start + cost; the next request admitted is the one
with the smallest finish tag, and V moves to that request's start. A tenant that queued many long
generations has far-away finish tags, so a quiet tenant's short call goes ahead of them instead of
waiting behind the whole flood. With `fair=False` the order is the old one: priority, then
arrival (the off switch of `meshlm serve --no-tenant-isolation`).

Under overload (a full queue) the lowest priority is shed first: `victim_for()` names the waiting
request to drop so that a new one can take its place: the request served last if its priority is
below the new one's; else, in fair mode, the last request of the tenant that holds the most queued
tokens at the new request's priority, if that is another tenant and holds more than the new
request's tenant would (so a flood cannot fill the queue and lock a quiet tenant out).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Entry:
    request: Any
    tenant: str
    priority: int
    cost: int  # tokens asked for
    seq: int  # arrival order
    finish: float = 0.0  # virtual finish tag (fair mode)
    start: float = 0.0


@dataclass
class FairQueue:
    fair: bool = True
    _entries: list[Entry] = field(default_factory=list)
    _seq: int = 0
    _vtime: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    _last_finish: dict[tuple[int, str], float] = field(default_factory=dict)
    _queued_tokens: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.ordered())

    def queued_tokens(self, tenant: str) -> int:
        return self._queued_tokens.get(tenant, 0)

    def push(self, request: Any, tenant: str, priority: int, cost: int) -> Entry:
        self._seq += 1
        e = Entry(request, tenant, priority, max(1, cost), self._seq)
        v = self._vtime[priority]
        e.start = max(v, self._last_finish.get((priority, tenant), v))
        e.finish = e.start + e.cost
        self._last_finish[(priority, tenant)] = e.finish
        self._entries.append(e)
        self._queued_tokens[tenant] += e.cost
        return e

    def _key(self, e: Entry) -> tuple:
        return (-e.priority, e.finish, e.seq) if self.fair else (-e.priority, e.seq)

    def ordered(self) -> list[Entry]:
        """The waiting requests in the order they would be admitted."""
        return sorted(self._entries, key=self._key)

    def first(self, eligible: Callable[[Entry], bool] = lambda e: True) -> Entry | None:
        """The next request to admit among those `eligible` says may run now."""
        return next((e for e in self.ordered() if eligible(e)), None)

    def pop(self, e: Entry, served: bool = True) -> None:
        """Takes `e` out of the queue; a served request moves the virtual clock, a shed one not."""
        self._remove(e)
        if self.fair and served:
            self._vtime[e.priority] = max(self._vtime[e.priority], e.start)

    def remove_requests(self, pred: Callable[[Any], bool]) -> list[Any]:
        """Removes (without serving) the waiting requests `pred` picks; returns them."""
        gone = [e for e in self._entries if pred(e.request)]
        for e in gone:
            self._remove(e)
        return [e.request for e in gone]

    def victim_for(self, priority: int, tenant: str, cost: int) -> tuple[Entry, str] | None:
        """The waiting request a new one may displace from a full queue, and why (see above)."""
        if not self._entries:
            return None
        last = self.ordered()[-1]
        if last.priority < priority:
            return last, (
                f"a request of priority {priority} took the place of this one (priority "
                f"{last.priority}, the lowest waiting)"
            )
        if not self.fair:
            return None
        held: dict[str, int] = defaultdict(int)
        for e in self._entries:
            if e.priority == priority:
                held[e.tenant] += e.cost
        heavy = max(held, key=held.__getitem__, default=None)
        if heavy is None or heavy == tenant or held[heavy] <= held[tenant] + cost:
            return None
        mine = [e for e in self._entries if e.tenant == heavy and e.priority == priority]
        return max(mine, key=self._key), (
            f"tenant {heavy!r} holds the most queued tokens at priority {priority} "
            f"({held[heavy]}) and another tenant's request took the place of this one"
        )

    def requests(self) -> Iterable[Any]:
        return [e.request for e in self._entries]

    def _remove(self, e: Entry) -> None:
        self._entries.remove(e)
        left = self._queued_tokens[e.tenant] - e.cost
        if left > 0:
            self._queued_tokens[e.tenant] = left
        else:
            self._queued_tokens.pop(e.tenant, None)
            # an idle tenant starts again from the virtual clock, not from an old backlog
            for key in [k for k in self._last_finish if k[1] == e.tenant]:
                del self._last_finish[key]
