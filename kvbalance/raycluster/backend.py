"""The real cluster's front-end half: a ``server.backend.Backend`` over instance actors.

The server's engine thread calls it like one engine. ``add_request`` routes a request with the simulator's
own router classes (``cluster.routers``: ``round_robin``, ``least_loaded``, ``cache_aware``, ``kv_aware``,
``load_aware``, ...) over each live prefill / colocated actor's latest ``Instance.load()`` (from its last
step report, plus the requests sent to it since, counted as waiting), and queues an ``add`` command for it.
``step()`` sends every actor with work its queued commands in a ``step`` call (one call in flight per
actor: its steps follow each other as the engine loop's would; an idle actor gets an empty call every
``HEALTH_INTERVAL_S``, so a dead one is noticed before a request is routed to it), waits for the first reply (``WAIT_S``), and
turns each :class:`~kvbalance.raycluster.actor.StepReport` into the ``RequestOutput`` list the engine thread
streams: tokens (detokenised and stop-string checked here, as ``LLMEngine.step`` does), P/D hand-offs
(the decode router picks a decode actor, which gets the prompt, the first token and the KV's ObjectRef),
failed loads and migration replies (``migration.LiveMigrations``).

Faults: a step call that raises (the actor died or broke) takes the instance out (the routers pick among the
live ones from then on, its store pins dropped, migrations with it ended) and each of its requests is retried on
another instance if nothing was streamed yet (at most ``MAX_RETRIES`` times), else failed with an
:class:`InstanceError` naming the instance (``server.backend.RequestFailed``: the client's stream ends with
that error). The other instances' requests go on untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from kvbalance.cluster.routers import build_router
from kvbalance.engine import InstanceLoad
from kvbalance.llm.engine import RequestOutput, chat_prompt_ids, encode_prompt
from kvbalance.llm.text import Detokenizer, emit_delta, find_stop
from kvbalance.raycluster.actor import InstanceInfo, StepReport
from kvbalance.raycluster.config import ServeClusterConfig
from kvbalance.raycluster.migration import LiveMigrations
from kvbalance.request import Request, RequestState, SamplingParams
from kvbalance.server.backend import RequestFailed

log = logging.getLogger(__name__)

WAIT_S = 0.01  # how long one step() waits for an actor's reply
MAX_RETRIES = 2  # a request that streamed nothing is re-routed at most this often after instance failures
HEALTH_INTERVAL_S = 1.0  # an idle instance gets an empty step call this often while the cluster has work


class InstanceError(RuntimeError):
    """A request lost to an instance failure after it had streamed tokens."""


@dataclass
class Slot:
    """One instance actor as the front end sees it."""

    index: int
    name: str
    role: str
    actor: object
    info: InstanceInfo
    alive: bool = True
    load: InstanceLoad | None = None
    outbox: list[tuple] = field(default_factory=list)
    in_flight: object = None  # the ObjectRef of its step call
    queued: dict[str, Request] = field(default_factory=dict)  # adds not sent yet
    sent: dict[str, Request] = field(default_factory=dict)  # adds sent in the call in flight
    routed: int = 0
    reports: int = 0
    error: str | None = None
    last_call_s: float = 0.0

    def has_work(self) -> bool:
        ld = self.load
        return ld is not None and (ld.num_running + ld.num_waiting + ld.num_loading) > 0


@dataclass
class Tracked:
    """A request in flight, as the client sees it: the front end's mirror of it and where it lives."""

    req: Request
    sampling: SamplingParams
    home: int
    phase: str  # "colocated", "prefill" (P/D, to its first token) or "decode"
    detok: Detokenizer | None
    streamed: int = 0
    retries: int = 0


def empty_load(info: InstanceInfo) -> InstanceLoad:
    return InstanceLoad(info.name, 0, 0, 0, 0, 0, 0, 0, 0, info.kv_capacity_tokens, 0.0, 0, 0, 0, 0, 0)


def sum_loads(loads: list[InstanceLoad], name: str = "cluster") -> InstanceLoad:
    """Field-wise sum of ``loads`` (the cluster's totals for the server's gauges)."""
    fields = [f.name for f in dataclasses.fields(InstanceLoad) if f.name != "name"]
    return InstanceLoad(name, *(sum(getattr(ld, f) for ld in loads) for f in fields))


class ClusterBackend:
    def __init__(
        self,
        slots: list[Slot],
        config: ServeClusterConfig,
        *,
        model_name: str,
        tokenizer=None,
        store=None,
    ) -> None:
        import ray

        if not slots:
            raise ValueError("instances: a cluster needs at least one instance")
        self._ray = ray
        self.slots = slots
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.store = store
        first = slots[0].info
        if any(s.info.block_size != first.block_size for s in slots):
            raise ValueError("block_size: every instance of a cluster must use the same KV block size")
        self._block_size = first.block_size
        self.eos_token_id = first.eos_token_id
        self.requests: dict[str, Request] = {}
        self.tracked: dict[str, Tracked] = {}
        self.counters = {
            "pd_transfers": 0,
            "pd_transfer_bytes": 0,
            "retries": 0,
            "failed_requests": 0,
            "instance_failures": 0,
        }
        self.lock = threading.Lock()  # /metrics reads counters and loads from the HTTP thread
        self.num_reports = 0
        self._t0 = time.perf_counter()
        self.migrations = LiveMigrations(self, config.llumnix, block_bytes=first.kv_bytes_per_block)
        self.llumnix = config.llumnix  # Llumnix's pairing rounds run while it is set
        self._build_routers()

    # -- facts --------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def alive(self, index: int) -> bool:
        return self.slots[index].alive

    def live(self, roles=("colocated", "prefill", "decode")) -> list[Slot]:
        return [s for s in self.slots if s.alive and s.role in roles]

    @property
    def max_context(self) -> int:
        return min(s.info.max_context for s in self.slots)

    @property
    def vocab_size(self) -> int:
        return self.slots[0].info.vocab_size

    @property
    def kv_capacity_tokens(self) -> int:
        return min(s.info.kv_capacity_tokens for s in self.slots)

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_steps(self) -> int:
        return self.num_reports

    def load(self) -> InstanceLoad:
        return sum_loads([s.load or empty_load(s.info) for s in self.live()])

    def effective_load(self, s: Slot) -> InstanceLoad:
        """``s``'s latest reported load plus the requests sent to it since (as waiting requests)."""
        ld = s.load or empty_load(s.info)
        extra = [*s.queued.values(), *s.sent.values()]
        if not extra:
            return ld
        return dataclasses.replace(
            ld,
            num_waiting=ld.num_waiting + len(extra),
            queued_prefill_tokens=ld.queued_prefill_tokens + sum(r.num_tokens for r in extra),
            remaining_output_tokens=ld.remaining_output_tokens
            + sum(r.max_tokens - r.num_output_tokens for r in extra),
        )

    def request_blocks(self, rid: str) -> int:
        """Blocks of KV ``rid`` holds by the front end's count (its tokens so far, the last one not computed)."""
        t = self.tracked.get(rid)
        if t is None:
            return 0
        return -(-(t.req.num_tokens - 1) // self._block_size)

    # -- tokenising (the server's tokenizer thread) ------------------------------------------------
    def encode(self, prompt) -> list[int]:
        return encode_prompt(self.tokenizer, self.vocab_size, prompt)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    # -- requests (engine thread) ------------------------------------------------------------------
    def _build_routers(self) -> None:
        cfg, bs = self.config, self._block_size
        self.router = build_router(cfg.router, bs, **cfg.router_options)
        self.decode_router = build_router(cfg.decode_router, bs)
        self._candidates()

    def _candidates(self) -> None:
        """The live instances each router picks among (routers key their state by instance name, so an
        instance leaving keeps the others' state with them)."""
        self.frontends = self.live(("colocated", "prefill"))
        self.decoders = self.live(("decode",))

    def rejection_reason(self, req: Request) -> str | None:
        need = req.num_prompt_tokens + req.max_tokens
        if need > self.max_context:
            return (
                f"context_length: prompt ({req.num_prompt_tokens}) + max_tokens ({req.max_tokens}) = {need} "
                f"exceeds the model context ({self.max_context})"
            )
        blocks = -(-req.max_total_tokens // self._block_size)
        smallest = min(s.info.num_blocks for s in self.slots)
        if blocks > smallest:
            return (
                f"kv_capacity: needs {req.max_total_tokens} KV tokens, more than an instance's whole cache "
                f"({smallest * self._block_size} tokens) can ever hold"
            )
        if not self.frontends:
            return "instances: no prefill or colocated instance is alive"
        return None

    def add_request(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> Request:
        rid = request_id or f"req-{len(self.requests)}-{time.monotonic_ns()}"
        if rid in self.tracked:
            raise ValueError(f"request_id: {rid!r} is already in use")
        params = params or SamplingParams()
        req = Request(rid, list(prompt), params, arrival_s=self.now(), eos_token_id=self.eos_token_id)
        reason = self.rejection_reason(req)
        if reason is not None:
            req.state, req.reject_reason, req.finish_s = RequestState.REJECTED, reason, self.now()
            return req
        detok = Detokenizer() if self.tokenizer is not None else None
        t = Tracked(req, params, -1, "", detok)
        self.tracked[rid] = t
        self.requests[rid] = req
        self._route(t)
        return req

    def _route(self, t: Tracked) -> None:
        cands = self.frontends
        i = self.router.choose(t.req, [self.effective_load(s) for s in cands])
        s = cands[i]
        pd = s.role == "prefill" and t.sampling.max_tokens > 1
        t.home, t.phase = s.index, "prefill" if s.role == "prefill" else "colocated"
        rid = t.req.request_id
        self.send(s.index, ("add", rid, list(t.req.prompt_token_ids), t.sampling, self.eos_token_id, pd))
        s.queued[rid] = t.req
        s.routed += 1

    def abort(self, request_id: str) -> None:
        t = self.tracked.pop(request_id, None)
        self.requests.pop(request_id, None)
        if t is not None and t.home >= 0:
            self.send(t.home, ("abort", request_id))

    def send(self, index: int, command: tuple) -> None:
        s = self.slots[index]
        if s.alive:
            s.outbox.append(command)

    def rehome(self, rid: str, index: int) -> None:
        t = self.tracked.get(rid)
        if t is not None:
            t.home = index

    def has_unfinished(self) -> bool:
        return bool(self.tracked) or any(
            s.alive and (s.outbox or s.in_flight is not None) for s in self.slots
        )

    def set_llumnix(self, section) -> None:
        """Turn Llumnix's automatic pairing on (a ``LlumnixSection``) or off (None); moves in flight go on."""
        self.llumnix = section
        if section is not None:
            self.migrations.section = section

    def migrate(self, request_id: str, dst: int) -> bool:
        """Start a live migration of ``request_id`` to instance ``dst`` (both colocated); False if it cannot."""
        t = self.tracked.get(request_id)
        if t is None or t.phase != "colocated" or not self.alive(dst) or self.slots[dst].role != "colocated":
            return False
        return self.migrations.start(t.home, dst, request_id) is not None

    # -- stepping --------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        now = self.now()
        for s in self.slots:
            if not s.alive or s.in_flight is not None:
                continue
            # an idle instance is called now and then too (an empty step): a dead one is found and skipped
            if s.outbox or s.queued or s.has_work() or now - s.last_call_s >= HEALTH_INTERVAL_S:
                cmds, s.outbox = s.outbox, []
                s.sent, s.queued = s.queued, {}
                s.last_call_s = now
                s.in_flight = s.actor.step.remote(cmds)

    def step(self) -> list:
        ray = self._ray
        self._dispatch()
        outputs: list = []
        inflight = {s.in_flight: s for s in self.slots if s.in_flight is not None}
        if not inflight:
            time.sleep(WAIT_S / 5)
            return outputs
        refs = list(inflight)
        ready, _ = ray.wait(refs, num_returns=1, timeout=WAIT_S)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in ready:
            s = inflight[ref]
            s.in_flight = None
            try:
                report = ray.get(ref)
            except Exception as exc:  # the actor died, or its step raised: take it out
                self._died(s, exc, outputs)
                continue
            self._on_report(s, report, outputs)
        if self.llumnix is not None:
            loads = {s.index: self.effective_load(s) for s in self.live(("colocated",))}
            if len(loads) > 1:
                self.migrations.tick(loads, self._block_size)
        self._dispatch()  # the next calls go out at once
        return outputs

    def _on_report(self, s: Slot, report: StepReport, outputs: list) -> None:
        with self.lock:
            s.load = report.load
            s.reports += 1
            self.num_reports += 1
        s.sent = {}
        for o in report.outputs:
            self._on_token(s, o, outputs)
        for hd in report.handoffs:
            self._on_handoff(hd, outputs)
        for rid, reason in report.failed:
            t = self.tracked.get(rid)
            if t is not None and t.home == s.index:
                self._lose(t, f"{s.name}: {reason}", outputs)
        for reply in report.replies:
            self.migrations.on_reply(s.index, reply)
        self._reap_lost(s, outputs)

    def _on_token(self, s: Slot, o, outputs: list) -> None:
        t = self.tracked.get(o.rid)
        if t is None or t.home != s.index:
            return
        req, now = t.req, self.now()
        req.output_token_ids.append(o.token)
        if req.first_token_s is None:
            req.first_token_s = now
        req.token_times_s.append(now)
        if o.logprob is not None:
            req.output_logprobs.append(o.logprob)
        t.streamed += 1
        finished, reason = o.finished, o.finish_reason
        delta, text, lazy = "", "", None
        tok, detok = self.tokenizer, t.detok
        if tok is not None and detok is not None:
            stops = req.sampling.stop
            if stops:  # searched at every token, as LLMEngine does: decode now
                added = detok.step(tok, req.output_token_ids)
                if added and not finished:
                    cut = find_stop(detok.text, stops, len(added))
                    if cut is not None:
                        detok.text = detok.text[:cut]
                        finished, reason = True, "stop"
                        self.send(s.index, ("abort", o.rid))  # frees its blocks there
                delta, text = emit_delta(detok, stops, finished), detok.text
            else:
                n = len(req.output_token_ids)
                lazy = (tok, detok, detok.defer(n), n)
        if finished:
            req.state, req.finish_reason, req.finish_s = RequestState.FINISHED, reason, now
            self._forget(o.rid)
        outputs.append(RequestOutput(o.rid, [o.token], delta, finished, reason, req, text, lazy))

    def _on_handoff(self, hd, outputs: list) -> None:
        t = self.tracked.get(hd.rid)
        if t is None:  # finished (a stop string on its first token) or aborted: the KV object just goes
            return
        with self.lock:
            self.counters["pd_transfers"] += 1
            self.counters["pd_transfer_bytes"] += hd.nbytes
        if not self.decoders:
            self._lose(t, "no decode instance is alive", outputs)
            return
        i = self.decode_router.choose(t.req, [self.effective_load(d) for d in self.decoders])
        d = self.decoders[i]
        t.home, t.phase = d.index, "decode"
        req = t.req
        cmd = ("add_decode", hd.rid, list(req.prompt_token_ids), list(req.output_token_ids), t.sampling,
               self.eos_token_id, [hd.ref])  # fmt: skip
        self.send(d.index, cmd)
        d.queued[hd.rid] = req
        d.routed += 1

    def _lose(self, t: Tracked, why: str, outputs: list) -> None:
        """``t``'s instance cannot go on with it: retry it elsewhere if nothing was streamed, else fail it."""
        rid = t.req.request_id
        if t.streamed == 0 and t.retries < MAX_RETRIES and self.frontends:
            t.retries += 1
            with self.lock:
                self.counters["retries"] += 1
            self._route(t)
            return
        self._forget(rid)
        t.req.state, t.req.finish_s = RequestState.ABORTED, self.now()
        with self.lock:
            self.counters["failed_requests"] += 1
        err = InstanceError(f"request {rid}: {why} after {t.streamed} tokens were streamed")
        outputs.append(RequestFailed(rid, err))

    def _forget(self, rid: str) -> None:
        self.tracked.pop(rid, None)
        self.requests.pop(rid, None)

    def _died(self, s: Slot, exc: BaseException, outputs: list) -> None:
        log.error("instance %s failed: %s", s.name, exc)
        with self.lock:
            s.alive = False
            s.error = f"{type(exc).__name__}: {exc}"[:500]
            self.counters["instance_failures"] += 1
        s.outbox, s.queued, s.sent = [], {}, {}
        self._candidates()
        self.migrations.on_death(s.index)
        if self.store is not None:
            self.store.release_owner.remote(s.name)
        for t in list(self.tracked.values()):
            if t.home == s.index:
                self._lose(t, f"instance {s.name} died ({type(exc).__name__})", outputs)
        try:
            self._ray.kill(s.actor, no_restart=True)
        except Exception:  # already gone
            pass

    def _reap_lost(self, s: Slot, outputs: list) -> None:
        """Safety net: an instance that reports no request at all cannot still hold one of ours."""
        if s.has_work() or s.outbox or s.queued:
            return
        committing = {mv.rid for mv in self.migrations.active.values() if mv.state == "commit"}
        for t in list(self.tracked.values()):
            if t.home == s.index and t.req.request_id not in committing:
                log.error("request %s lost on %s", t.req.request_id, s.name)
                self._lose(t, f"lost on {s.name}", outputs)

    # -- reports and shutdown -------------------------------------------------------------------------
    def instance_rows(self) -> list[dict]:
        with self.lock:
            rows = []
            for s in self.slots:
                ld = s.load or empty_load(s.info)
                rows.append({"instance": s.name, "role": s.role, "alive": s.alive, "routed": s.routed,
                             "reports": s.reports, "load": ld, "error": s.error})  # fmt: skip
            return rows

    def check(self) -> dict[str, dict]:
        """Every live instance's block accounting (``InstanceWorker.check``), by name (idle instances only)."""
        ray = self._ray
        live = [s for s in self.slots if s.alive]
        return dict(zip([s.name for s in live], ray.get([s.actor.check.remote() for s in live])))

    def close(self) -> None:
        for s in self.slots:
            try:
                self._ray.kill(s.actor, no_restart=True)
            except Exception:
                pass
            s.alive = False
