"""BanaServe's adaptive migration algorithm as a policy object.

BanaServe chooses migrations M to minimise the peak utilisation ``max_g U_g(M)`` under a budget on the
migration's latency. Here, with the monitor's per-GPU combined utilisation U_g:

1. nothing while a migration is in flight or cooling down (``cooldown_s`` after the last one landed);
2. a hot GPU that keeps up is no source: when its queued work (``queue_util``, seconds over the window)
   is below ``min_source_queue`` and its KV memory is not what binds, moving its work elsewhere cannot
   raise throughput, only add a hand-off to its steps (a decode GPU is busy whenever it has requests);
3. hysteresis: balancing starts when ``max U - min U > start_imbalance`` and stops only once it falls
   below ``stop_imbalance`` (a band, not one threshold, so noise around a threshold cannot toggle it);
4. the kind: attention-level (move some heads' K/V of running decodes, fine-grained) for a small
   imbalance (below ``layer_imbalance``) or a memory-bound hot GPU; layer-level (move a range of layers,
   coarse) for a large compute-bound one; the other kind only when the preferred one has no valid move;
5. among that kind's candidates from the hot GPU within ``max_transfer_s``, keep those that lower the
   peak by at least ``min_gain`` and do not overshoot (the destination ends at most ``stop_imbalance``
   above the source, so the move cannot call for its own reversal) nor saturate the destination (its
   predicted utilisation stays <= 1: past that its own work queues), and pick the best balance gain
   (drop of max U - min U) per second of transfer.

A chosen move becomes a :class:`Migration` with a start and a finish time; its effect (a callback)
runs only when its transfer finishes, and service never stops meanwhile.

Wiring (the cluster's side): after every step, ``monitor.record_step(gpu, start, result.breakdown,
result.duration_s)`` (a pipelined instance records each stage on its own GPU); each control tick,
``migrator.step(now, monitor.snapshot(now), lambda: candidates_from(...), on_finish=apply)``, where
``reserve_move`` runs at the start and ``apply`` commits the memory (``commit_move``) and switches the
instance's step time to ``pipeline_step`` / ``attention_split_step``; ``cancel`` (with
``cancel_move``) when the requests being moved all leave first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvbalance.cluster.monitor import GPUUtilization

LAYER, ATTENTION = "layer", "attention"
KINDS = (LAYER, ATTENTION)


@dataclass(frozen=True)
class MigrationConfig:
    """Thresholds of the adaptive migration (utilisations are fractions of wall time, 0..1).

    Why each default:

    - ``start_imbalance = 0.25``: a quarter of a GPU idle beside a busy one is worth a move costing
      tens of milliseconds to a few seconds; below it, the routers' own balancing (load-aware routing)
      handles the spread and a move's transfer would cost more than it frees.
    - ``stop_imbalance = 0.10``: the band's lower edge; step-level noise of a steady load in a 2 s
      window is a few percent, so 0.10 keeps the band (0.15 wide) above the noise.
    - ``layer_imbalance = 0.50``: layer moves carry weights (hundreds of MB to GB for 13B models) and
      add a hand-off per step; only an imbalance of half a GPU or more pays for that; attention moves
      shift at most the decode attention share, which suits smaller gaps.
    - ``min_gain = 0.05``: a move must lower the peak by more than the window's noise (a few %).
    - ``cooldown_s = 4.0``: two monitor windows (2 s default): one for the landed move to fill the
      window with post-move steps, one more so the next decision sees a settled load.
    - ``max_transfer_s = 2.0``: BanaServe's migration latency budget; a move longer than the window
      would land after the imbalance it was for has changed.
    - ``min_coverage = 1.0``: decide only on full windows (no decisions while warming up).
    - ``memory_bound_share = 0.5``: the hot GPU is memory-bound when memory-bound operators take the
      larger part of its operator time (the roofline's majority), or when KV occupancy binds.
    - ``min_source_queue = 0.1``: a tenth of the window (0.2 s of a 2 s window) of queued work; less
      drains within a few steps on its own, while a move costs a transfer and, for a layer move, a
      hand-off on every later step. Measured: a decode GPU 95% busy with no queue and every request
      within its SLO (bursty llama-2-13b on 2P + 2D) lost goodput to a move the busy time alone asked for.
    """

    start_imbalance: float = 0.25
    stop_imbalance: float = 0.10
    layer_imbalance: float = 0.50
    min_gain: float = 0.05
    cooldown_s: float = 4.0
    max_transfer_s: float = 2.0
    min_coverage: float = 1.0  # fraction of the monitor's window the samples must span
    memory_bound_share: float = 0.5
    min_source_queue: float = 0.1

    def __post_init__(self) -> None:
        for f in (
            "start_imbalance",
            "stop_imbalance",
            "layer_imbalance",
            "min_gain",
            "min_coverage",
            "memory_bound_share",
            "min_source_queue",
        ):
            v = getattr(self, f)
            if not 0 <= v <= 1:
                raise ValueError(f"{f}: must be in [0, 1], got {v!r}")
        if self.stop_imbalance >= self.start_imbalance:
            raise ValueError(
                f"stop_imbalance: must be below start_imbalance ({self.start_imbalance}) for hysteresis, "
                f"got {self.stop_imbalance}"
            )
        for f in ("cooldown_s", "max_transfer_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f}: must be >= 0, got {getattr(self, f)!r}")


@dataclass(frozen=True)
class MigrationCandidate:
    """A possible move, priced by ``kvbalance.perf.migration``; utilisations predicted after it lands."""

    kind: str  # LAYER or ATTENTION
    src: str
    dst: str
    transfer_s: float
    src_util_after: float
    dst_util_after: float
    weight_bytes: int = 0
    kv_bytes: int = 0
    layers: tuple[int, int] | None = None  # LAYER: the range moved
    kv_heads: int = 0  # ATTENTION: KV heads moved

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.src == self.dst:
            raise ValueError(f"dst: a move needs two GPUs, got {self.src!r} twice")
        if self.transfer_s < 0:
            raise ValueError(f"transfer_s: must be >= 0, got {self.transfer_s!r}")


@dataclass
class Migration:
    """A move in flight from ``start_s``; its effect applies at ``finish_s`` (when its bytes have landed)."""

    candidate: MigrationCandidate
    start_s: float
    finish_s: float
    on_finish: Callable[[Migration], None] | None = None
    state: str = "in_flight"  # in_flight -> done | cancelled

    def finish(self) -> None:
        if self.state != "in_flight":
            raise ValueError(f"state: migration already {self.state}")
        self.state = "done"
        if self.on_finish is not None:
            self.on_finish(self)


@dataclass(frozen=True)
class Decision:
    """What the policy decided and why (for logs and tests)."""

    action: str  # "none", LAYER or ATTENTION
    reason: str
    imbalance: float = 0.0
    candidate: MigrationCandidate | None = None
    score: float = 0.0  # balance gain per second of transfer


Candidates = Sequence[MigrationCandidate] | Callable[[], Sequence[MigrationCandidate]]


@dataclass
class AdaptiveMigrator:
    """Decides and tracks migrations. ``step(now, utils, candidates)`` is one control tick."""

    config: MigrationConfig = field(default_factory=MigrationConfig)
    window_s: float = 2.0  # the monitor's window (for ``min_coverage``)
    armed: bool = False  # inside the hysteresis band's "balancing" state
    in_flight: list[Migration] = field(default_factory=list)
    history: list[Migration] = field(default_factory=list)
    last_finish_s: float | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(
        self, candidate: MigrationCandidate, now: float, on_finish: Callable[[Migration], None] | None = None
    ) -> Migration:
        m = Migration(candidate, now, now + candidate.transfer_s, on_finish)
        self.in_flight.append(m)
        self.history.append(m)
        return m

    def advance(self, now: float) -> list[Migration]:
        """Finish (and apply) every migration whose transfer has landed by ``now``, in finish order."""
        done = sorted((m for m in self.in_flight if m.finish_s <= now), key=lambda m: m.finish_s)
        for m in done:
            self.in_flight.remove(m)
            m.finish()
            self.last_finish_s = m.finish_s
        return done

    def cancel(self, migration: Migration, now: float) -> None:
        """Abandon an in-flight move (e.g. its requests all finished); the cool-down starts now."""
        if migration not in self.in_flight:
            raise ValueError("migration: not in flight")
        self.in_flight.remove(migration)
        migration.state = "cancelled"
        self.last_finish_s = now

    # -- the decision --------------------------------------------------------------------------------
    def decide(self, now: float, utils: Mapping[str, GPUUtilization], candidates: Candidates) -> Decision:
        """``candidates``: the moves, or a function building them (called only when a move is due)."""
        cfg = self.config
        if self.in_flight:
            return Decision("none", "a migration is in flight")
        if self.last_finish_s is not None and now < self.last_finish_s + cfg.cooldown_s:
            return Decision("none", "cooling down")
        ready = {g: u for g, u in utils.items() if u.covered_s >= cfg.min_coverage * self.window_s - 1e-12}
        if len(ready) < 2 or len(ready) < len(utils):
            return Decision("none", "window not full yet")
        u = {g: x.combined for g, x in ready.items()}
        hot = max(sorted(u), key=u.__getitem__)
        cold = min(sorted(u), key=u.__getitem__)
        imbalance = u[hot] - u[cold]
        h = ready[hot]
        if h.queue_util is not None and h.queue_util < cfg.min_source_queue and h.kv_util < h.combined:
            return Decision("none", "the hot GPU keeps up (no queue)", imbalance)
        if not self.armed and imbalance > cfg.start_imbalance:
            self.armed = True
        elif self.armed and imbalance < cfg.stop_imbalance:
            self.armed = False
        if not self.armed:
            return Decision("none", "balanced", imbalance)
        if callable(candidates):
            candidates = candidates()
        small = imbalance < cfg.layer_imbalance
        memory_bound = h.memory_share > cfg.memory_bound_share or (h.kv_util > 0 and h.kv_util >= h.combined)
        prefer = ATTENTION if small or memory_bound else LAYER
        for kind in (prefer, LAYER if prefer == ATTENTION else ATTENTION):
            best = self._best(kind, hot, u, imbalance, candidates)
            if best is not None:
                cand, score, gain = best
                why = "preferred" if kind == prefer else f"no valid {prefer} move"
                return Decision(kind, f"{why}: imbalance -{gain:.3f}", imbalance, cand, score)
        return Decision("none", "no move lowers the peak enough", imbalance)

    def _best(
        self,
        kind: str,
        hot: str,
        u: Mapping[str, float],
        imbalance: float,
        candidates: Sequence[MigrationCandidate],
    ) -> tuple[MigrationCandidate, float, float] | None:
        cfg = self.config
        best: tuple[MigrationCandidate, float, float] | None = None
        for c in candidates:
            if c.kind != kind or c.src != hot or c.dst not in u or c.transfer_s > cfg.max_transfer_s:
                continue
            after = dict(u)
            after[c.src], after[c.dst] = c.src_util_after, c.dst_util_after
            peak_drop = u[hot] - max(after.values())
            if peak_drop < cfg.min_gain:
                continue  # BanaServe's objective: the peak must come down
            if c.dst_util_after - c.src_util_after > cfg.stop_imbalance:
                continue  # overshoots: the reverse move could follow (ping-pong)
            if c.dst_util_after > 1.0:
                continue  # the helper would saturate: its own work would start to queue
            gain = imbalance - (max(after.values()) - min(after.values()))
            if gain <= 0:
                continue
            score = gain / max(c.transfer_s, 1e-9)
            if best is None or score > best[1]:
                best = (c, score, gain)  # first of equals wins: candidates' order breaks ties
        return best

    def step(
        self,
        now: float,
        utils: Mapping[str, GPUUtilization],
        candidates: Candidates,
        on_finish: Callable[[Migration], None] | None = None,
    ) -> tuple[Decision, Migration | None]:
        """One control tick: land finished moves, decide, and start the chosen move (if any)."""
        self.advance(now)
        d = self.decide(now, utils, candidates)
        if d.candidate is None:
            return d, None
        return d, self.start(d.candidate, now, on_finish)
