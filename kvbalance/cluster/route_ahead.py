"""Routing ahead: a member of a cluster behind a router of counts runs past arrivals it can prove go elsewhere.

A member runs ahead of the clock (``InstanceDriver.ahead``) only to the next event that can read or change it.
Behind ``least_loaded`` that is every arrival: the router reads every member's counts. But a member whose
score at an arrival is provably above another's is not picked, so it may run on past it (its counts then
recorded for the router, ``PastLoad``); it stops only at arrivals it might receive. Exact: the same run bit for
bit (tests/test_decode_cohort.py, tests/test_route_ahead.py).

The proof. The router picks the lowest score ``a (waiting + loading) + b running`` (``Router.count_weights``;
``least_loaded``: a = 4, b = 1), the lowest index on ties. Where this is on (``Cluster``: colocated members on
the cohort, no P/D, store, monitor, migration or callbacks on finishes), a member's counts change only at its
own steps and its arrivals, or at loud events (``EventLoop.at``: aborts, outside preemptions), which nothing
runs past. Within a step in flight its counts are fixed (admissions and preemptions happen when a step is
scheduled, finishes when it ends). So its score rises only by (a) an arrival routed to it (+a, a request
waits) and (b) a preemption (running -> waiting, +(a - b)); finishes and admissions lower it. Its total
waiting + loading + running never rises but by arrivals (+1), so ``max(a, b) x total`` bounds its score
whatever it preempts.

No preemption (the guard). A member's *slack* is its available blocks (free plus evictable cached ones,
``KVCacheManager.num_available_blocks``) minus the blocks its requests can still take: over its running,
waiting and loading requests, ceil((prompt + max_tokens) / block_size) - len(block_ids). While slack >= 0 no
allocation fails (one for a request takes at most what it can still take), so nothing is preempted
(``Scheduler._grow`` preempts only when ``allocate_slots`` fails) and slack never falls: an allocation lowers
both sides alike; an admission takes a prefix hit's blocks (the need falls by the whole hit, the available
blocks by its unlocked part only) and new ones (both alike); a finish frees blocks and its need; publishing a
block in the prefix cache leaves a held block held. Only an arrival lowers it, by the request's whole need. So
a lower bound ``slack[i]``, set exactly at the start, lowered by each arrival's need as it is routed to ``i``
(computed exactly again, before the request joins, when it gets low) holds from then on; while it is at least
``window_blocks``, the most any ``WINDOW`` consecutive arrivals can take, ``i`` cannot preempt before the
``WINDOW``-th next arrival, whichever of them it gets.

The bound. ``U[i]`` bounds member i's score at every arrival it has not run past, for as long as it receives
none: where the guard holds, its score at the first arrival it ran past that is not routed yet (the highest
of its records), else the score of its step in flight (or idle) when it last stopped; where it does not,
``max(a, b) x total`` of the same counts. It is set whenever i stops, receives an arrival or has a record
routed, so between those times its counts only fall (a loud event sets them all again). Let k be the first
unrouted arrival. Member j, having run past k .. k + l - 1 (so it receives none of them), is at arrival
k + l in a step whose counts give it the score S_j. Order the members by (U, index). Of the other members,
one of the l + 1 first receives none of the l arrivals before k + l (its score at most its U), and the first
receives at most l (score at most U + a l): if either is below (S_j, j) in (score, index) order, the router
does not pick j there, and j runs past arrival k + l, recording its counts. The router is checked: picking a
member that ran past the arrival raises.
"""

from __future__ import annotations

import math
from bisect import insort
from collections import deque
from collections.abc import Callable
from typing import Any

from kvbalance.cluster.lazy_load import PastLoad
from kvbalance.request import Request

WINDOW = 16  # a member runs past at most this many arrivals beyond the first unrouted one


class RouteAhead:
    """The bookkeeping of routing ahead for ``cluster`` (its frontends fixed, all colocated) behind a router
    with ``count_weights`` ``weights``: each member's horizon (its next arrival not run past), the crossing
    checks its driver asks (``InstanceDriver.cross``, ``cohort_cross``), the records the router reads."""

    def __init__(self, cluster: Any, weights: tuple[int, int]) -> None:
        self.cluster = cluster
        self.loop = cluster.loop
        self.members = list(cluster.frontends)
        self.a, self.b = weights
        self.times: list[float] = cluster._arrival_times  # pending and past arrival times, sorted
        self.bs = cluster.block_size
        self.blocks: list[int] = []  # per arrival, as ``times``: the most blocks its request can take
        # the most blocks WINDOW consecutive arrivals can take (until ``start``: more than any slack, so every
        # bound is the cap, whatever preempts)
        self.window_blocks = 1 << 62
        n = self.n = len(self.members)
        self.passed = [-1] * n  # member -> the last arrival it ran past
        # member -> (arrival, PastLoad: its counts there, its U key from them); the key's guard holds while it
        # has records (it receives nothing then)
        self.recs: list[deque] = [deque() for _ in range(n)]
        self.at: dict[int, list[int]] = {}  # arrival -> the members that ran past it
        self.slack = [0] * n  # member -> a lower bound of its slack (blocks)
        self.margin = [m.instance.kv.pool.num_blocks // 4 for m in self.members]
        self.passes = 0  # arrivals run past (all members)
        self.keys = [i for i in range(n)]  # member -> U * n + its index
        self.sorted_keys = sorted(self.keys)
        self._loud = 0  # loud events run when the bounds were last all set
        # each member's counts for the router, set at each arrival (``loads``)
        self._live = [(PastLoad(m.instance.name, 0, 0, 0), m.instance.scheduler) for m in self.members]

    # -- requests and arrivals -------------------------------------------------------------------
    def need(self, req: Request) -> int:
        """The most blocks ``req`` can take: ceil((prompt + max_tokens) / block_size)."""
        return -(-(req.max_total_tokens + 1) // self.bs)

    def submitted(self, index: int, req: Request) -> None:
        """``req``'s arrival was put at ``index`` of the arrival times."""
        self.blocks.insert(index, self.need(req))
        if self.cluster._running:
            self._window()
            self._all()

    def _window(self) -> None:
        b = self.blocks
        s = best = sum(b[:WINDOW])
        for x in range(WINDOW, len(b)):
            s += b[x] - b[x - WINDOW]
            if s > best:
                best = s
        self.window_blocks = best

    def passed_until_s(self) -> float:
        """The latest arrival any member ran past (-inf: none): a later submission must come after it."""
        p = max(self.passed)
        return self.times[p] if p >= 0 else -math.inf

    def start(self) -> None:
        self._window()
        for i in range(self.n):
            self.slack[i] = self._exact_slack(i)
        self._all()

    def _exact_slack(self, i: int) -> int:
        sched = self.members[i].instance.scheduler
        bs = self.bs
        need = 0
        for reqs in (sched.running, sched.waiting, sched.loading.values()):
            for r in reqs:
                need += -(-(r.max_total_tokens + 1) // bs) - len(r.block_ids)
        return sched.kv.num_available_blocks - need

    def loads(self, j: int) -> list:
        """The loads the router reads for arrival ``j``: each member's counts (``PastLoad``s of the counts now,
        reused: read them inside ``choose``), or the counts then of the members that ran past it."""
        live = self._live
        for ld, sched in live:  # the counts now (a router with count_weights reads nothing else)
            ld.num_waiting = len(sched.waiting)
            ld.num_loading = len(sched.loading)
            ld.num_running = len(sched.running)
        loads: list = [ld for ld, _ in live]
        past = self.at.pop(j, None)
        if past is not None:
            self.passes += len(past)
            recs, keys = self.recs, self.keys
            for i in past:
                q = recs[i]
                loads[i] = q.popleft()[1]
                if q:  # its bound: its next record's
                    if q[0][2] != keys[i]:
                        self._move(i, q[0][2])
                else:
                    self.refresh(i)  # its bound may fall
        return loads

    def routed(self, j: int, i: int, req: Request) -> None:
        """Arrival ``j`` (``req``) goes to member ``i``, which has not taken it yet (and then sets its
        bound, :meth:`refresh`)."""
        if self.passed[i] >= j:
            raise RuntimeError(
                f"route ahead: {self.members[i].name} ran past arrival {j} ({req.request_id}), which the router "
                "gave it"
            )
        b = self.need(req)
        s = self.slack[i] - b
        if s < self.margin[i]:
            s = self._exact_slack(i) - b
        self.slack[i] = s

    # -- the bounds ------------------------------------------------------------------------------
    def refresh(self, i: int) -> None:
        """Set member ``i``'s bound U from its counts now (or its first unrouted record)."""
        q = self.recs[i]
        if q:
            key = q[0][2]
        else:
            sched = self.members[i].instance.scheduler
            key = self._key(i, len(sched.waiting), len(sched.loading), len(sched.running))
        if key != self.keys[i]:
            self._move(i, key)

    def _key(self, i: int, w: int, ld: int, r: int) -> int:
        """U x n + i of member ``i`` with these counts: its score where the guard holds, else its cap."""
        if self.slack[i] >= self.window_blocks:
            return (self.a * (w + ld) + self.b * r) * self.n + i
        return max(self.a, self.b) * (w + ld + r) * self.n + i

    def _move(self, i: int, key: int) -> None:
        sk = self.sorted_keys
        sk.remove(self.keys[i])
        insort(sk, key)
        self.keys[i] = key

    def _all(self) -> None:
        for i in range(self.n):
            self.refresh(i)
        self._loud = self.loop.loud_done

    # -- the members' horizons and crossings ----------------------------------------------------------
    def horizon(self, i: int) -> Callable[[], float]:
        """``InstanceDriver.ahead`` of member ``i``: its next arrival not run past, or a loud event first."""
        cluster, times, passed, loop = self.cluster, self.times, self.passed, self.loop

        def ahead() -> float:
            k = cluster._arrived
            p = passed[i]
            j = p + 1 if p >= k else k
            own = times[j] if j < len(times) else math.inf
            loud = loop.next_loud_time()
            return own if own < loud else loud

        return ahead

    def idle(self, i: int) -> Callable[[], None]:
        """``InstanceDriver.on_idle`` of member ``i``: it stopped with nothing to do."""
        return lambda: self.refresh(i)

    def crosser(self, i: int) -> Callable[..., float | None]:
        """``InstanceDriver.cross`` (and ``cohort_cross``) of member ``i``: ``cross(start_s, end_s, running,
        waiting=0, loading=0)``: a step from ``start_s`` to ``end_s`` (at or past the horizon) with these
        counts runs past each next arrival it spans that the router provably gives another; returns the horizon
        after them (``end_s`` is before it), or None: it stops."""
        cluster, times, passed, loop = self.cluster, self.times, self.passed, self.loop
        q = self.recs[i]
        at = self.at
        a, b, n = self.a, self.b, self.n
        keys, sk = self.keys, self.sorted_keys
        key_of, move, slack = self._key, self._move, self.slack
        an = a * n
        name = self.members[i].instance.name

        def cross(start_s: float, end_s: float, r: int, w: int = 0, ld: int = 0) -> float | None:
            if self._loud != loop.loud_done:
                self._all()
            key = (a * (w + ld) + b * r) * n + i  # (score, index) at the arrivals the step spans
            loud = loop.next_loud_time()
            k = cluster._arrived
            p = passed[i]
            j = p + 1 if p >= k else k
            mine = keys[i]
            first = sk[0] if sk[0] != mine else sk[1]  # the other member first in (U, index) order
            load = None
            rec_key = 0
            while True:
                t = times[j] if j < len(times) else math.inf
                h = t if t < loud else loud
                if end_s < h:
                    return h
                if not (t < loud and start_s < t < end_s):
                    break
                l_ = j - k  # arrivals before j still to route (none to this member)
                if l_ > WINDOW:
                    break
                if not first + an * l_ < key:  # the first may get them all
                    if l_ >= n - 1 or not (sk[l_] if sk[l_] < mine else sk[l_ + 1]) < key:
                        break  # (one of the l + 1 first gets none)
                if load is None:
                    load = PastLoad(name, w, ld, r)
                    rec_key = key if slack[i] >= self.window_blocks else key_of(i, w, ld, r)
                q.append((j, load, rec_key))
                lst = at.get(j)
                if lst is None:
                    at[j] = [i]
                else:
                    lst.append(i)
                passed[i] = j
                j += 1
            # it stops: its bound from this step's counts (or its first record)
            new = q[0][2] if q else key if slack[i] >= self.window_blocks else key_of(i, w, ld, r)
            if new != mine:
                move(i, new)
            return None

        return cross
