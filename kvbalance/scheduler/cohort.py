"""The decode cohort: a simulator fast path where a step costs O(prefill sequences + block events), not O(batch).

Most of a simulated step's running requests are plain decodes: one token each, sampled, the length rule the
only one that can stop them (``ignore_eos``, no stop tokens, no logprobs). Between events each such request
changes in a way known ahead: at cohort step g it computes position ``c0 + g - g0``, samples the stand-in token
of the next position (the executor's ``decode_tokens``) and gets that step's end time. So the scheduler keeps
them as a cohort — counts and one context sum in the plan (``BatchPlan.cohort_seqs`` / ``cohort_context``) —
and touches a member only at its events, in the running order the step-by-step path meets them:

* it needs a new block (every ``block_size`` steps: members are bucketed by their step residue),
* it fills a block (its publication in the prefix cache is noted with the tick it would take and done when
  anything reads that part of the cache, ``KVCacheManager.defer_full_block``; or done now, tokens written first),
* it reaches ``max_tokens`` (known when it joins),
* it is preempted, or anything outside reads or changes the scheduler's requests: :meth:`settle` writes every
  member's tokens, token times and computed tokens (``Instance.load``, aborts, invariant checks call it).

A request joins when it samples and is eligible. A step whose decodes exceed the token budget, or whose new
blocks might need a preemption, dissolves the cohort first and runs the step-by-step logic for everyone (the
same code with an empty cohort); they rejoin at their next sample. Steps that are the cohort's alone (nothing
waits, no one prefills) run without a plan (:meth:`cohort_run`, from ``Instance.cohort_run_begin``). The result is the step-by-step
path's, bit for bit: same plans' shapes and times, same block ids, cache publications and frees in the same
order, same tokens and token times (tests/test_decode_cohort.py).

A mixin of :class:`~kvbalance.scheduler.core.Scheduler`, on only after :meth:`enable_cohort` (``Instance``
enables it for an executor that takes cohort plans, where nothing reads requests between steps).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Sequence

from kvbalance.batch import BatchPlan, ScheduledSeq, StepResult
from kvbalance.request import Request, RequestState


class _Member:
    """A request of the cohort: it joined at cohort step ``g0`` with ``c0`` computed tokens and ``o0`` outputs;
    its lists are written up to step ``done``; ``pos`` is its place in the running order."""

    __slots__ = ("req", "rid", "c0", "o0", "g0", "done", "pos", "key", "flush", "note")

    def __init__(self, req: Request, g: int, pos: int, block_size: int) -> None:
        self.req = req
        self.rid = req.request_id
        self.c0 = req.num_computed_tokens
        self.o0 = len(req.output_token_ids)
        self.g0 = self.done = g
        self.pos = pos
        self.key = (g - self.c0) % block_size  # its position is a block's first at steps g = key (mod bs)
        self.flush = None  # publishes its filled blocks, deferred (KVCacheManager.defer_full_block)
        self.note = None  # that deferral's note, while live (its leaf not None): later fills counted on it

    def __lt__(self, other: _Member) -> bool:
        return self.pos < other.pos


class CohortScheduling:
    """The cohort half of the scheduler (state set by :meth:`enable_cohort`; ``_cohort`` is None while off)."""

    _cohort: dict[str, _Member] | None

    def enable_cohort(self, tokens: Callable[[str, int, int], Sequence[int]]) -> None:
        """Turn the cohort on. ``tokens(request_id, first_context_len, count)``: the tokens a step-by-step run
        samples over ``count`` decode steps (``SimExecutor.decode_tokens``)."""
        if self._cohort is not None:
            return
        self._cohort = {}
        self._tokens = tokens
        self._buckets: dict[int, list[_Member]] = {}  # step residue -> members, in running order
        self._fin: dict[int, list[_Member]] = {}  # cohort step -> members whose last token it samples
        self._ends: list[float] = []  # end time of each cohort step
        self._g = 0  # cohort steps done
        self._cbase = 0  # sum of (c0 - g0): members' contexts after step g sum to _cbase + n * (g + 1)
        self._pos: dict[str, int] = {r.request_id: i for i, r in enumerate(self.running)}
        self._next_pos = len(self.running)
        self._others: list[Request] | None = None  # running requests outside the cohort (None: rebuild)
        self._step_decodes = 0  # decodes outside the cohort at the front of the last plan's seqs

    @property
    def cohort_size(self) -> int | None:
        """Members of the decode cohort (None: the cohort is off)."""
        return None if self._cohort is None else len(self._cohort)

    # -- members ---------------------------------------------------------------------------------
    def _catch_up(self, m: _Member, j: int) -> None:
        k = m.done
        if j > k:
            req = m.req
            d = m.c0 - m.g0
            req.num_computed_tokens = d + j
            req.output_token_ids.extend(self._tokens(m.rid, d + k + 1, j - k))
            req.token_times_s.extend(self._ends[k:j])
            m.done = j

    def _publish(self, m: _Member) -> None:
        """Publish a member's deferred blocks (its lists written up to now first)."""
        self._catch_up(m, self._g)
        self.kv.publish_deferred(m.req)

    def _drop(self, m: _Member) -> None:
        """Take a member out of the cohort (its lists already written)."""
        del self._cohort[m.rid]
        self._buckets[m.key].remove(m)
        fin = self._fin.get(m.g0 + m.req.sampling.max_tokens - m.o0 - 1)
        if fin is not None and m in fin:
            fin.remove(m)
        self._cbase -= m.c0 - m.g0
        if not self._cohort:
            self._reset_clock()

    def _reset_clock(self) -> None:
        self._buckets.clear()
        self._fin.clear()
        self._ends = []
        self._g = 0
        self._cbase = 0

    def _join(self, req: Request) -> None:
        bs = self.block_size
        m = _Member(req, self._g, self._pos[req.request_id], bs)
        m.flush = lambda: self._publish(m)
        self._cohort[m.rid] = m
        bucket = self._buckets.get(m.key)
        if bucket is None:
            self._buckets[m.key] = [m]
        elif not bucket or bucket[-1].pos < m.pos:
            bucket.append(m)
        else:
            insort(bucket, m)
        last = m.g0 + req.sampling.max_tokens - m.o0 - 1
        fin = self._fin.get(last)
        if fin is None:
            self._fin[last] = [m]
        else:
            insort(fin, m)
        self._cbase += m.c0 - m.g0

    def _cohort_enter(self, req: Request) -> None:
        """``req`` was appended to the running list (admitted, or its KV load landed)."""
        self._pos[req.request_id] = self._next_pos
        self._next_pos += 1
        if self._others is not None:
            self._others.append(req)

    def _cohort_forget(self, req: Request) -> None:
        """``req`` leaves the running list (preempted, finished or taken from outside): its lists written to
        now, out of the cohort."""
        m = self._cohort.get(req.request_id)
        if m is not None:
            self._catch_up(m, self._g)
            self._drop(m)
        elif self._others is not None and req in self._others:
            self._others.remove(req)
        self._pos.pop(req.request_id, None)

    def settle(self) -> None:
        """Write every member's tokens, token times and computed tokens up to now (a step in flight is still
        to come, as on the step-by-step path): the requests are then exactly what that path has. The cohort
        stays; a caller that takes a request out of the running list calls :meth:`_cohort_forget` for it."""
        cohort = self._cohort
        if cohort is None:
            return
        self._others = None  # the caller may change the running list
        g = self._g
        kv = self.kv
        for m in cohort.values():
            if m.done != g:
                self._catch_up(m, g)
            kv.publish_deferred(m.req)

    def _dissolve(self) -> None:
        """:meth:`settle` and empty the cohort (members rejoin at their next sample); between steps only."""
        self.settle()
        if self._cohort:
            self._cohort.clear()
            self._reset_clock()

    # -- runs of cohort-only steps (Instance.cohort_run_begin) ------------------------------------------------
    def cohort_run_ready(self) -> bool:
        """Whether the next step is the cohort's alone, as :meth:`schedule` would plan it: nothing waits, loads
        or is held, every running request is a member, the policy runs the running requests first (sarathi,
        vllm) and they fit its token budget, and the connector has nothing to do per step."""
        cohort = self._cohort
        if not cohort or self.waiting or self.loading or self._held:
            return False
        if not (self._null_connector or getattr(self.connector, "passive", False)):
            return False
        if self._others is None:
            self._others = [r for r in self.running if r.request_id not in cohort]
        if self._others:
            return False
        name = self.policy.name
        return name == "vllm" or (name == "sarathi" and len(cohort) <= self.config.max_num_batched_tokens)

    def cohort_run(
        self,
        now: float,
        horizon_s: float,
        step_fn: Callable[[int], Callable[[int], float]],
        on_step: Callable[[float, float, int, list[Request]], None],
        begin: Callable[[float, float, int], None] | None = None,
        cross: Callable[[float, float, int], float | None] | None = None,
    ) -> float:
        """Run the steps from ``now`` that are the cohort's alone, each as :meth:`schedule` then :meth:`update`
        of its plan would (the members' new blocks in running order when it is planned, their fills and
        finishes when it ends), without a plan. ``step_fn(n)`` gives a step's duration from its members'
        context sum (``SimExecutor.decode_step_fn``); ``on_step(start_s, duration_s, members, finished)``
        follows each step. Stops before a step that would end at or after ``horizon_s`` and one whose new
        blocks might need a preemption (both then go the planned way). Returns the time reached.

        With ``begin``, the step that would end at or after ``horizon_s`` is begun instead, as :meth:`schedule`
        would plan it (its new blocks allocated, unless they might need a preemption: then not) and
        ``begin(start_s, duration_s, members)`` told; its end is :meth:`cohort_step_end`. With ``begin`` and
        ``cross``, that step's new blocks allocated, ``cross(start_s, end_s, members)`` is asked first (the
        counts during the step: ``members`` running, none waiting): a later horizon to run the step and go on
        to (it ends before it), or None to begin it as without ``cross``."""
        if not self.cohort_run_ready():
            return now
        cohort = self._cohort
        running = RequestState.RUNNING
        t = now
        fn, fn_n = None, -1
        # _cohort_grow and _advance inline (the same operations), for the usual step: no one finishes
        bs = self.block_size
        buckets, fin, kv = self._buckets, self._fin, self.kv
        caching = self.cache is not None
        none: tuple = ()
        while cohort:  # nothing joins or waits in a run: it stays the cohort's alone while members are left
            n = len(cohort)
            g = self._g
            if n != fn_n:
                fn, fn_n = step_fn(n), n
            d = fn(self._cbase + n * (g + 1))
            end = t + d
            if not end < horizon_s:
                if begin is None or not self._cohort_grow(g):
                    break
                h = cross(t, end, n) if cross is not None else None
                if h is None:
                    self._step_decodes = 0
                    begin(t, d, n)
                    break
                horizon_s = h
            else:
                bucket = buckets.get(g % bs)
                if bucket:
                    grow = [m.req for m in bucket if m.c0 + g - m.g0 >= len(m.req.block_ids) * bs]
                    if grow:
                        if len(grow) > kv.num_available_blocks:
                            break  # they might need a preemption
                        kv.allocate_one_each(grow)
            if g not in fin:
                self._ends.append(end)
                self._g = g + 1
                if caching:
                    fills = buckets.get((g + 1) % bs)
                    if fills:
                        self._fills(fills)
                on_step(t, d, n, none)
            else:
                finished: list[Request] = []
                self._members_end(end, finished)
                if finished:
                    self.running = [r for r in self.running if r.state is running]
                on_step(t, d, n, finished)
            t = end
        return t

    def _cohort_grow(self, g: int) -> bool:
        """Allocate the new blocks of cohort step ``g`` (members at a block's first position, in running order);
        False (nothing allocated): they might need a preemption."""
        bs = self.block_size
        bucket = self._buckets.get(g % bs)
        if bucket:
            grow = [m.req for m in bucket if m.c0 + g - m.g0 >= len(m.req.block_ids) * bs]
            if grow:
                kv = self.kv
                if len(grow) > kv.num_available_blocks:
                    return False
                kv.allocate_one_each(grow)  # one block each (a decode at a block's first position)
        return True

    def cohort_step_end(self, now: float) -> list[Request]:
        """The end, at ``now``, of a step :meth:`cohort_run` began: what :meth:`update` does with its plan (the
        members' fills and finishes in running order); returns the requests that finished."""
        finished: list[Request] = []
        if self._cohort:  # (members taken out while it ran are out of the lists)
            self._members_end(now, finished)
            if finished:
                running = RequestState.RUNNING
                self.running = [r for r in self.running if r.state is running]
        return finished

    def _members_end(self, now: float, finished: list[Request]) -> None:
        """The cohort's part of a step's end at ``now`` (:meth:`_advance`): its members' fills (:meth:`_fills`,
        where none finishes) or each member's events in running order, the finished added to ``finished``."""
        events, fins = self._advance(now)
        if fins is None:
            if events:
                self._fills(events)
        else:
            for m in events:
                self._member_event(m, fins, now, finished)

    def _advance(self, now: float) -> tuple[list[_Member], list[_Member] | None]:
        """One cohort step done at ``now``: the members with an event, in running order, and those finishing."""
        g = self._g
        self._ends.append(now)
        self._g = g + 1
        fills = self._buckets.get((g + 1) % self.block_size) if self.cache is not None else None
        fins = self._fin.pop(g, None)
        if fills and fins:
            return sorted({id(m): m for m in (*fills, *fins)}.values()), fins
        if fins:
            return list(fins), fins  # (finishing members leave the lists)
        return fills or (), None  # (read only: nobody leaves)

    def _member_event(
        self, m: _Member, fins: list[_Member] | None, now: float, finished: list[Request]
    ) -> None:
        """A member's block fill (published) and or last token (finished), as the step-by-step update does."""
        req = m.req
        if self.cache is not None and (m.c0 + self._g - m.g0) % self.block_size == 0:  # a block filled
            # published now, or noted and published when something reads it (the same cache in the end)
            m.note = self.kv.defer_full_block(req, m.flush)
            if m.note is None:
                self._catch_up(m, self._g)
                self.kv.cache_full_blocks(req)
        if fins is not None and m in fins:
            self._catch_up(m, self._g)
            self.kv.publish_deferred(req)
            self._drop(m)
            self._pos.pop(m.rid, None)
            self._release(req, finished=True)
            req.state = RequestState.FINISHED
            req.finish_reason = "length"
            req.finish_s = now
            finished.append(req)

    def _fills(self, members: list[_Member]) -> None:
        """:meth:`_member_event` of each of ``members`` (in running order) at a step where none finishes: each
        filled a block; one whose deferral is live counts it on its note (what ``defer_full_block`` does)."""
        tick = self.kv.cache.take_tick
        for m in members:
            note = m.note
            if note is not None and note[0] is not None:
                note[1] += 1
                note[2] = tick()
            else:
                self._member_event(m, None, 0.0, [])

    # -- a step ----------------------------------------------------------------------------------
    def _cohort_schedule_running(self, plan: BatchPlan, budget: int) -> int:
        """:meth:`Scheduler.schedule_running` with the cohort's members as counted decodes."""
        cohort = self._cohort
        others = self._others
        if others is None:
            others = self._others = [r for r in self.running if r.request_id not in cohort]
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in others:
            if r._num_prompt + len(r.output_token_ids) - r.num_computed_tokens == 1:
                decodes.append(r)
            else:
                prefills.append(r)
        bs = self.block_size
        grow: list[_Member] = []
        if cohort:
            g = self._g
            bucket = self._buckets.get(g % bs)
            if bucket:
                grow = [m for m in bucket if m.c0 + g - m.g0 >= len(m.req.block_ids) * bs]
            need = len(grow)
            for r in decodes:
                if r.num_computed_tokens >= len(r.block_ids) * bs:
                    need += 1
            if len(cohort) + len(decodes) > budget or (need and need > self.kv.num_available_blocks):
                # a decode might go without budget or blocks (a preemption): everyone step by step
                self._dissolve()
                return self._cohort_schedule_running(plan, budget)
        seqs = plan.seqs
        first = len(seqs)  # the sequences this call schedules are seqs[first:]
        preempted = self.num_preemptions
        running = RequestState.RUNNING
        kv = self.kv
        if not decodes:  # the usual step: the members' new blocks, in running order
            if grow:
                kv.allocate_one_each([m.req for m in grow])  # each decode is a block's first token
            order = ()
        elif grow:  # both in running order
            pos = self._pos
            order = sorted([(m.pos, m) for m in grow] + [(pos[r.request_id], r) for r in decodes],
                           key=lambda x: x[0])  # fmt: skip
        else:
            order = [(0, r) for r in decodes]
        for _, x in order:
            if isinstance(x, _Member):
                if not kv.allocate_one(x.req):  # its decode is a block's first token
                    raise RuntimeError("block accounting: a cohort decode's block failed to allocate")
                continue
            req = x
            if budget <= 0:
                break
            if preempted != self.num_preemptions and req.state is not running:
                continue  # preempted earlier in this step
            computed = req.num_computed_tokens
            if computed >= len(req.block_ids) * bs and not self._grow(req, computed, 1, seqs, first):
                continue
            seqs.append(ScheduledSeq(req, computed, 1, True))
            budget -= 1
        self._step_decodes = len(seqs) - first
        if cohort:
            n = len(cohort)
            plan.cohort_seqs = n
            plan.cohort_context = self._cbase + n * (self._g + 1)
            budget -= n
        return self._schedule_prefills(prefills, seqs, budget, first, preempted)

    def _seq_end(
        self, s: ScheduledSeq, result: StepResult, now: float, finished: list[Request]
    ) -> tuple[bool, bool]:
        """A scheduled sequence's end (``Scheduler._apply_seq``), its request finished if it is done; returns
        (whether it may join the cohort, whether it finished)."""
        reason, plain = self._apply_seq(s, result, now)
        if reason is None:
            return plain, False
        req = s.request
        self._finish_step(req, reason, now, finished)
        self._pos.pop(req.request_id, None)
        return plain, True

    def cohort_chunk_end(self, plan: BatchPlan, result: StepResult, now: float) -> list[Request]:
        """:meth:`_cohort_update` of a plan that is the cohort plus one prompt chunk of two or more tokens (no other
        decodes, no transfers; ``Instance.step``'s fast path): the members' fills and finishes in running order,
        then the chunk's tokens, its sample, its filled blocks, its finish or its joining."""
        finished: list[Request] = []
        if self._cohort:  # (members taken out while it ran are out of the lists)
            self._members_end(now, finished)
        s = plan.seqs[0]
        req = s.request
        running = RequestState.RUNNING
        if req.state is not running:  # aborted while the step ran
            if finished:
                self.running = [r for r in self.running if r.state is running]
            return finished
        join, others_changed = self._seq_end(s, result, now, finished)
        if finished:
            self.running = [r for r in self.running if r.state is running]
        if join and req.state is running:
            self._join(req)
            others_changed = True
        if others_changed and self._others is not None:
            cohort = self._cohort
            self._others = [r for r in self._others if r.state is running and r.request_id not in cohort]
        return finished

    def _cohort_update(self, plan: BatchPlan, result: StepResult, now: float) -> list[Request]:
        """:meth:`Scheduler.update` with the cohort: members' block fills and finishes in running order among
        the other decodes, then the prompt chunks; requests that sampled join."""
        finished: list[Request] = []
        running = RequestState.RUNNING
        if result.finished_loads or result.finished_saves:
            self._apply_transfers(result.finished_loads, result.finished_saves)
        cohort = self._cohort
        events: list[_Member] = []
        fins: list[_Member] | None = None
        if plan.cohort_seqs and cohort:
            events, fins = self._advance(now)
        seqs = plan.seqs
        k = self._step_decodes if plan.cohort_seqs else 0
        if events and k:  # other decodes among the members' events: running order
            pos = self._pos
            order = sorted([(m.pos, 0, m) for m in events]
                           + [(pos.get(s.request.request_id, -1), 1, s) for s in seqs[:k]],
                           key=lambda x: x[:2])  # fmt: skip
            items = [x[2] for x in order] + seqs[k:]
        elif events:
            items = [*events, *seqs]
        else:
            items = seqs
        join: list[Request] = []
        others_changed = False
        for s in items:
            if isinstance(s, _Member):
                self._member_event(s, fins, now, finished)
                continue
            req = s.request
            if req.state is not running:
                continue  # aborted while the step ran
            plain, ended = self._seq_end(s, result, now, finished)
            if plain:
                join.append(req)
            if ended:
                others_changed = True
        if finished:
            self.running = [r for r in self.running if r.state is running]
        for req in join:
            if req.state is running:
                self._join(req)
                others_changed = True
        if others_changed and self._others is not None:
            self._others = [r for r in self._others if r.state is running and r.request_id not in cohort]
        return finished
