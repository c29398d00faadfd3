"""Routing ahead: a member of a cluster behind a router of counts runs past arrivals it can prove go elsewhere.

A member runs ahead of the clock (``InstanceDriver.ahead``) only to the next event that can read or change it.
Behind ``least_loaded`` that is every arrival: the router reads every member's counts. But a member whose
score at an arrival is provably above another's is not picked, so it may run on past it (its counts then
recorded for the router, ``PastLoad``); it stops only at arrivals it might receive. Exact: the same run bit for
bit (tests/test_decode_cohort.py).

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
both sides alike; an admission takes a prefix hit's blocks (``need`` falls by the hit, available by the hit's
unlocked part only) and new ones (both alike); a finish frees blocks and its need; publishing a block in the
prefix cache leaves a held block held. Only an arrival lowers it, by the request's whole need. So a lower
bound ``slack[i]``, set exactly at the start, lowered by each arrival's need as it is routed to ``i`` (and
computed exactly again, before the request joins, when it gets low) holds from then on; while it is at least
the needs of the next ``WINDOW`` arrivals, ``i`` cannot preempt before the last of them, whichever it gets.

The bound. Let k be the first unrouted arrival. For each member i, ``U_i`` bounds its score at any arrival
T_(k+l) before which it receives none of T_k .. T_(k+l-1): its score at T_k — its record if it ran past T_k,
else its live counts (they are those at a time at or before T_k, or those of a step in flight across T_k; and
they only fall) — where the guard holds, else ``max(a, b) x total``. Each arrival among T_k .. adds at most a.
Member j, having run past T_k .. T_(k+l-1) (so it receives none of them), is at T_(k+l) in a step whose counts
give it the score S_j. Of the other members, sorted by U (u_(1) <= u_(2) <= ...), one of the l + 1 lowest
receives none of the l arrivals (score <= u_(l+1)) and the lowest receives at most l (score <= u_(1) + a l):
some other member scores at most B_l = min(u_(l+1), u_(1) + a l). If S_j > B_l (strictly: ties go to the lower
index) the router does not pick j: j runs past T_(k+l), recording its counts there. Bounds computed at k hold
at a later first unrouted arrival k' too (with l counted from k), so they are recomputed only when a check
fails and k has moved, or a loud event has run. The router is checked: picking a member that ran past the
arrival raises.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from kvbalance.cluster.lazy_load import PastLoad
from kvbalance.request import Request

WINDOW = 32  # a member runs past at most this many arrivals beyond the first unrouted one


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
        n = len(self.members)
        self.passed = [-1] * n  # member -> the last arrival it ran past
        self.recs: list[deque] = [deque() for _ in range(n)]  # member -> (arrival, waiting, loading, running)
        self.slack = [0] * n  # member -> a lower bound of its slack (blocks)
        self.margin = [m.instance.kv.pool.num_blocks // 4 for m in self.members]
        self.passes = 0  # arrivals run past (all members)
        self._k0 = -(1 << 62)  # the first unrouted arrival when the bounds were computed
        self._loud = -1  # loud events run then
        self._su: list[int] = []  # the bounds U, sorted
        self._rank = [0] * n  # member -> its place in _su

    # -- requests and arrivals -------------------------------------------------------------------
    def need(self, req: Request) -> int:
        """The most blocks ``req`` can take: ceil((prompt + max_tokens) / block_size)."""
        return -(-(req.max_total_tokens + 1) // self.bs)

    def submitted(self, index: int, req: Request) -> None:
        """``req``'s arrival was put at ``index`` of the arrival times."""
        self.blocks.insert(index, self.need(req))

    def passed_until_s(self) -> float:
        """The latest arrival any member ran past (-inf: none): a later submission must come after it."""
        p = max(self.passed)
        return self.times[p] if p >= 0 else -math.inf

    def start(self) -> None:
        for i in range(len(self.members)):
            self.slack[i] = self._exact_slack(i)

    def _exact_slack(self, i: int) -> int:
        sched = self.members[i].instance.scheduler
        bs = self.bs
        need = 0
        for reqs in (sched.running, sched.waiting, sched.loading.values()):
            for r in reqs:
                need += -(-(r.max_total_tokens + 1) // bs) - len(r.block_ids)
        return sched.kv.num_available_blocks - need

    def route(self, j: int, loads: list) -> None:
        """Arrival ``j`` is being routed: the members that ran past it show their counts then."""
        for i, q in enumerate(self.recs):
            if q and q[0][0] == j:
                _, w, ld, r = q.popleft()
                loads[i] = PastLoad(self.members[i].instance.name, w, ld, r)

    def routed(self, j: int, i: int, req: Request) -> None:
        """Arrival ``j`` (``req``) goes to member ``i``, which has not taken it yet."""
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

    def crossers(
        self, i: int
    ) -> tuple[Callable[[float, float, int, int, int], float | None], Callable[[float, float, int], float | None]]:
        """``InstanceDriver.cross`` and ``cohort_cross`` of member ``i``: a step from ``start_s`` to ``end_s``
        (at or past the horizon) with these counts runs past each next arrival it spans that the router
        provably gives another; returns the horizon after them (``end_s`` is before it), or None: it stops."""
        cluster, times, passed, loop = self.cluster, self.times, self.passed, self.loop
        rec = self.recs[i].append
        a, b = self.a, self.b
        beats = self._beats

        def cross(start_s: float, end_s: float, w: int, ld: int, r: int) -> float | None:
            s = a * (w + ld) + b * r
            loud = loop.next_loud_time()
            k = cluster._arrived
            p = passed[i]
            j = p + 1 if p >= k else k
            while True:
                t = times[j] if j < len(times) else math.inf
                h = t if t < loud else loud
                if end_s < h:
                    return h
                if not (t < loud and start_s < t < end_s) or not beats(i, s, j, k):
                    return None
                rec((j, w, ld, r))
                passed[i] = j
                self.passes += 1
                j += 1

        def cohort_cross(start_s: float, end_s: float, running: int) -> float | None:
            return cross(start_s, end_s, 0, 0, running)

        return cross, cohort_cross

    def _beats(self, i: int, s: int, j: int, k: int) -> bool:
        """Whether member ``i`` with score ``s`` at arrival ``j`` (having run past ``k`` .. ``j`` - 1, the
        first unrouted ``k``) scores above some other member there, whatever the router did before."""
        fresh = False
        if self._loud != self.loop.loud_done or j - self._k0 > WINDOW:
            if j - k > WINDOW:
                return False
            self._bounds(k)
            fresh = True
        n = len(self._su)
        while True:
            su = self._su
            l_ = j - self._k0
            ri = self._rank[i]
            bound = (su[1] if ri == 0 else su[0]) + self.a * l_  # the lowest other gets them all
            x = l_ if l_ < ri else l_ + 1  # the (l + 1)-th lowest other: one of those gets none
            if x < n and su[x] < bound:
                bound = su[x]
            if s > bound:
                return True
            if fresh or self._k0 == k:
                return False
            self._bounds(k)  # tighter, from the counts now
            fresh = True

    def _bounds(self, k: int) -> None:
        """The bounds U at first unrouted arrival ``k``, sorted."""
        a, b = self.a, self.b
        cap = max(a, b)
        window = sum(self.blocks[k : k + WINDOW])  # what the next arrivals can take, wherever they go
        us = []
        for i, m in enumerate(self.members):
            q = self.recs[i]
            if q and q[0][0] == k:  # ran past k: its counts there
                _, w, ld, r = q[0]
            else:
                sched = m.instance.scheduler
                w, ld, r = len(sched.waiting), len(sched.loading), len(sched.running)
            us.append(a * (w + ld) + b * r if self.slack[i] >= window else cap * (w + ld + r))
        order = sorted(range(len(us)), key=us.__getitem__)
        self._su = [us[i] for i in order]
        for x, i in enumerate(order):
            self._rank[i] = x
        self._k0 = k
        self._loud = self.loop.loud_done
