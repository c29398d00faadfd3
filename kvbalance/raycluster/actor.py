"""One instance of the real cluster: an ``LLMEngine`` (real model, paged KV, the shared scheduler) in a Ray actor.

The front end drives it with ``step(commands)``: the commands (add, abort, a P/D hand-off's decode half,
the stages of a live migration, releases) are applied in order, KV loads whose objects arrived land
(``ActorConnector.poll``), one engine step runs if anything is schedulable, and a :class:`StepReport` comes
back: the tokens sampled, P/D hand-offs (the prompt's KV put into Ray's object store), failed loads,
migration replies and the instance's ``InstanceLoad`` (what the routers read). With nothing schedulable
but KV arriving, it waits up to ``IDLE_WAIT_S`` for a load instead of returning at once.

P/D prefill (``add`` with ``pd``): the request runs with ``max_tokens`` 1; when its prompt finishes, its
blocks are read (``TorchExecutor.read_blocks``), put into the object store (``ray.put``: the save) and
freed (the save landed), and the reply carries the ObjectRef. Global store: prompts that finish computing
have the full blocks the store lacks saved to it (``KVStoreActor.absent`` / ``put``).

Live migration (Llumnix's stages, driven by the front end): ``migrate_copy`` reads the request's blocks
``[clean, total)`` while it keeps decoding; ``migrate_reserve`` holds blocks for it on the destination and
writes the copy into them (``Scheduler.reserve_blocks``); ``migrate_stop`` detaches it at a step boundary
(``Scheduler.detach``: its blocks stay held) and sends the last dirty blocks with its state;
``migrate_commit`` admits it on the destination over the reserved blocks (``Scheduler.admit_reserved``) —
or, if the last blocks do not fit, queues it for recompute, as a preempted request; ``release`` frees the
source's held blocks once the destination has it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from kvbalance.cluster.connector import prompt_hashes
from kvbalance.cluster.llumnix import choose_request
from kvbalance.cluster.request_migration import can_migrate
from kvbalance.engine import InstanceLoad
from kvbalance.raycluster.connector import ActorConnector
from kvbalance.raycluster.wire import from_wire, to_wire
from kvbalance.request import Request, RequestState, SamplingParams

IDLE_WAIT_S = 0.005  # only KV in flight: how long a step call waits for a load before it returns


@dataclass(frozen=True)
class InstanceSpec:
    """What an instance actor builds: its name and role, the model and engine arguments, its cores."""

    name: str
    role: str
    model: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    cpu_cores: str | None = None
    threads: int | None = None


@dataclass
class TokenOut:
    rid: str
    token: int
    logprob: Any
    finished: bool
    finish_reason: str | None


@dataclass
class Handoff:
    """A P/D prefill's result: its first token is in ``TokenOut``; its prompt KV is ``ref`` (on the store)."""

    rid: str
    ref: Any  # ray.ObjectRef of (numpy array [layers, 2, blocks, block_size, kv_heads, head_dim], dtype)
    num_tokens: int
    nbytes: int


@dataclass
class StepReport:
    name: str
    outputs: list[TokenOut] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (rid, reason): the request ended here
    replies: list[tuple] = field(default_factory=list)  # migration replies
    load: InstanceLoad | None = None
    stepped: bool = False
    step_s: float = 0.0


@dataclass
class InstanceInfo:
    name: str
    role: str
    pid: int
    block_size: int
    num_blocks: int
    kv_capacity_tokens: int
    kv_bytes_per_block: int
    kv_dtype: str
    max_context: int
    vocab_size: int
    eos_token_id: int | None
    cpu_cores: str | None
    num_threads: int


class InstanceWorker:
    """The actor's body (``ray.remote`` is applied by the launcher, with the CPUs the spec's cores give)."""

    def __init__(self, spec: InstanceSpec, store=None) -> None:
        import torch

        from kvbalance.llm import LLMEngine

        self.spec = spec
        self.role = spec.role
        kw = {k: v for k, v in spec.engine_kwargs.items() if v is not None}
        self.connector = ActorConnector(spec.role, spec.name, store if spec.role != "decode" else None)
        self.engine = LLMEngine(
            spec.model,
            cpu_cores=spec.cpu_cores,
            num_threads=spec.threads,
            connector=self.connector,
            **kw,
        )
        self.inst = self.engine.instance
        self.inst.name = spec.name
        self.executor = self.engine.executor
        self.connector.bind(self.inst, self.executor)
        self.connector.kv_dtype = str(self.executor.kv_dtype).removeprefix("torch.")
        self.store = store if spec.role != "decode" else None
        self.requests: dict[str, Request] = {}
        self._pd_sampling: dict[str, SamplingParams] = {}  # P/D prefill: rid -> its real sampling params
        self._replies: list[tuple] = []
        self._failed: list[tuple[str, str]] = []
        self._t0 = time.perf_counter()
        self.num_threads = torch.get_num_threads()

    # -- facts ------------------------------------------------------------------------------------
    def info(self) -> InstanceInfo:
        ex, inst = self.executor, self.inst
        return InstanceInfo(
            self.spec.name,
            self.role,
            os.getpid(),
            ex.block_size,
            ex.num_blocks,
            inst.kv_capacity_tokens,
            ex.kv_bytes_per_block,
            self.connector.kv_dtype,
            inst.max_context,
            self.engine.config.vocab_size,
            self.engine.eos_token_id,
            self.spec.cpu_cores,
            self.num_threads,
        )

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def check(self) -> dict:
        """Block accounting (raises on a leak or double free) and what is held, for tests and shutdown."""
        self.inst.check_invariants()
        sched, pool = self.inst.scheduler, self.inst.pool
        cached = self.inst.cache.evictable_blocks if self.inst.cache is not None else 0
        return {
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "loading": sched.num_loading,
            "held": len(sched._held),
            "free_blocks": pool.num_free,
            "cached_blocks": cached,
            "num_blocks": pool.num_blocks,
            "loads_in_flight": len(self.connector.loads),
            "requests": len(self.requests),
        }

    def stats(self) -> dict:
        return dataclasses.asdict(self.connector.stats)

    def cpu_s(self) -> float:
        """CPU seconds this actor's process has used (all its threads): on a shared machine, what its work
        would take uncontended, roughly."""
        return time.process_time()

    # -- the step call ---------------------------------------------------------------------------
    def step(self, commands: list[tuple] = ()) -> StepReport:
        for cmd in commands:
            getattr(self, "_cmd_" + cmd[0])(*cmd[1:])
        conn, inst = self.connector, self.inst
        conn.poll(0.0)
        report = StepReport(self.spec.name)
        t0 = time.perf_counter()
        outcome = inst.step(self.now()) if inst.has_work() else None
        if outcome is not None:
            inst.complete(outcome, self.now())
            report.stepped = True
            self._collect(outcome.plan, report)
        elif conn.loads:  # nothing to compute until KV lands: wait a little for it here
            conn.poll(IDLE_WAIT_S)
        report.step_s = time.perf_counter() - t0
        for rid, reason in conn.take_failed():
            self.requests.pop(rid, None)
            self._failed.append((rid, reason))
        report.failed, self._failed = self._failed, []
        report.replies, self._replies = self._replies, []
        report.load = inst.load()
        return report

    def _collect(self, plan, report: StepReport) -> None:
        for s in plan.seqs:
            if not s.sample:
                continue
            req = s.request
            if req.request_id not in self.requests or not req.output_token_ids:
                continue
            lp = (
                req.output_logprobs[-1] if req.sampling.logprobs is not None and req.output_logprobs else None
            )
            report.outputs.append(
                TokenOut(req.request_id, req.output_token_ids[-1], lp, req.is_finished, req.finish_reason)
            )
        for done in self.connector.take_saves(plan):
            if self.store is not None:
                self._save_to_store(done.req, done.block_ids)
            if done.req.request_id in self._pd_sampling:
                self._hand_off(done.req, done.block_ids, report)
        for out in report.outputs:
            if out.finished:
                self.requests.pop(out.rid, None)

    def _hand_off(self, req: Request, block_ids: list[int], report: StepReport) -> None:
        """A P/D prefill finished its prompt: put its KV into the object store, free its blocks, report."""
        import ray

        rid = req.request_id
        real = self._pd_sampling.pop(rid)
        self.connector.pd_requests.discard(rid)
        self.requests.pop(rid, None)  # it leaves this instance whatever happens next
        if req.state is RequestState.FINISHED and req.finish_reason == "length" and real.max_tokens > 1:
            n = -(-req.num_prompt_tokens // self.executor.block_size)
            array, dtype = to_wire(self.executor.read_blocks(block_ids[:n]))
            ref = ray.put((array, dtype))
            report.handoffs.append(Handoff(rid, ref, req.num_prompt_tokens, array.nbytes))
            for out in report.outputs:
                if out.rid == rid:
                    out.finished, out.finish_reason = False, None  # it goes on on a decode instance
        self.inst.transfers_done([], [rid])  # the save landed (or there is nothing to hand off)

    def _save_to_store(self, req: Request, block_ids: list[int]) -> None:
        import ray

        bs = self.executor.block_size
        hashes = prompt_hashes(req, bs, req.num_prompt_tokens, self.inst.kv.hasher)
        if not hashes:
            return
        absent = set(ray.get(self.store.absent.remote(hashes)))
        idx = [i for i, h in enumerate(hashes) if h in absent]
        if not idx:
            return
        array, _ = to_wire(self.executor.read_blocks([block_ids[i] for i in idx]))
        self.store.put.remote([hashes[i] for i in idx], array)

    # -- commands -----------------------------------------------------------------------------
    def _add(self, req: Request) -> None:
        if not self.inst.add_request(req, self.now()):
            self._failed.append((req.request_id, f"rejected: {req.reject_reason}"))
            self.connector.forget(req.request_id)
            self._pd_sampling.pop(req.request_id, None)
            return
        self.requests[req.request_id] = req

    def _cmd_add(
        self, rid: str, prompt: list[int], sampling: SamplingParams, eos: int | None, pd: bool
    ) -> None:
        if pd:
            self._pd_sampling[rid] = sampling
            self.connector.pd_requests.add(rid)
            sampling = dataclasses.replace(sampling, max_tokens=1)
        self._add(Request(rid, list(prompt), sampling, arrival_s=self.now(), eos_token_id=eos))

    def _cmd_add_decode(
        self, rid: str, prompt: list[int], output: list[int], sampling: SamplingParams, eos, kv: list
    ) -> None:
        """The decode half of a P/D hand-off: ``kv`` is ``[ref]`` (a list, so Ray passes the ref itself)."""
        req = Request(rid, list(prompt), sampling, arrival_s=self.now(), eos_token_id=eos)
        req.output_token_ids = list(output)
        req.first_token_s = self.now()
        req.token_times_s = [req.first_token_s]
        self.connector.expect_handoff(rid, kv[0])
        self._add(req)

    def _cmd_abort(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        held_for_save = rid in self._pd_sampling
        self._pd_sampling.pop(rid, None)
        if req is not None and not req.is_finished:
            self.inst.abort(req, self.now())
        self.connector.forget(rid)
        if held_for_save:
            self.inst.transfers_done([], [rid])  # a P/D prefill's hold (taken by request_finished) goes

    def _cmd_release(self, rid: str) -> None:
        """A migrated request's blocks held here: the destination has it now."""
        self.inst.transfers_done([], [rid])

    # live migration, source side
    def _member(self):
        return SimpleNamespace(instance=self.inst)

    def _cmd_migrate_copy(self, rid: str | None, clean: int, policy: str, preemptions: int | None) -> None:
        import ray

        if rid is None:
            req = choose_request(self._member(), policy)
            if req is None:
                self._replies.append(("none", None))
                return
        else:
            req = self.requests.get(rid)
            reason = self._gone(req, preemptions)
            if reason is not None:
                self._replies.append(("gone", rid, reason))
                return
        bs = self.executor.block_size
        total = self.inst.pool.blocks_for_tokens(req.num_computed_tokens)
        array, dtype = to_wire(self.executor.read_blocks(req.block_ids[clean:total]))
        ref = ray.put((array, dtype))
        new_clean = req.num_computed_tokens // bs
        self._replies.append(("copied", req.request_id, [ref], clean, total, new_clean, req.num_preemptions))

    def _gone(self, req: Request | None, preemptions: int | None) -> str | None:
        if req is None or req.is_finished:
            return "finished" if req is None or req.state is not RequestState.ABORTED else "aborted"
        if (preemptions is not None and req.num_preemptions != preemptions) or not can_migrate(
            req, self._member()
        ):
            return "preempted"
        return None

    def _cmd_migrate_stop(self, rid: str, clean: int, preemptions: int) -> None:
        import ray

        req = self.requests.get(rid)
        reason = self._gone(req, preemptions)
        if reason is not None:
            self._replies.append(("gone", rid, reason))
            return
        sched = self.inst.scheduler
        sched.detach(req)
        held = sched._held[rid]
        total = self.inst.pool.blocks_for_tokens(req.num_computed_tokens)
        array, dtype = to_wire(self.executor.read_blocks(held[clean:total]))
        ref = ray.put((array, dtype))
        state = {
            "prompt": list(req.prompt_token_ids),
            "output": list(req.output_token_ids),
            "logprobs": list(req.output_logprobs),
            "sampling": req.sampling,
            "eos": req.eos_token_id,
            "num_computed_tokens": req.num_computed_tokens,
            "num_preemptions": req.num_preemptions,
        }
        del self.requests[rid]
        self._replies.append(("stopped", rid, [ref], clean, total, state))

    # live migration, destination side
    def _reserve_to(self, rid: str, total: int) -> bool:
        have = len(self.inst.scheduler._held.get(rid, []))
        return total <= have or self.inst.scheduler.reserve_blocks(rid, total - have)

    def _write_reserved(self, rid: str, first: int, total: int, kv: list) -> None:
        import ray

        array, dtype = ray.get(kv[0])
        held = self.inst.scheduler._held[rid]
        self.executor.write_blocks(held[first:total], from_wire(array, dtype))

    def _cmd_migrate_reserve(self, rid: str, first: int, total: int, kv: list) -> None:
        if not self._reserve_to(rid, total):
            self._replies.append(("reserve_failed", rid))
            return
        self._write_reserved(rid, first, total, kv)
        self._replies.append(("reserved", rid))

    def _cmd_migrate_cancel(self, rid: str) -> None:
        if rid in self.inst.scheduler._held:
            self.inst.transfers_done([rid], [])  # the reservation goes

    def _cmd_migrate_commit(self, rid: str, first: int, total: int, kv: list, state: dict) -> None:
        req = Request(
            rid, state["prompt"], state["sampling"], arrival_s=self.now(), eos_token_id=state["eos"]
        )
        req.output_token_ids = list(state["output"])
        req.output_logprobs = list(state["logprobs"])
        req.num_preemptions = state["num_preemptions"]
        req.first_token_s = self.now()
        req.token_times_s = [req.first_token_s]
        sched = self.inst.scheduler
        if self._reserve_to(rid, total):
            self._write_reserved(rid, first, total, kv)
            sched.admit_reserved(req, state["num_computed_tokens"])
            self.requests[rid] = req
            self.inst.transfers_done([rid], [])  # the copy landed: it runs here with its KV
            self._replies.append(("committed", rid, False))
            return
        self._cmd_migrate_cancel(rid)  # the last blocks do not fit: recompute here, as a preempted request
        self._add(req)
        self._replies.append(("committed", rid, True))
