"""Live request migration between colocated instance actors (Llumnix, OSDI '24 §4.2), driven by the front end.

The stages of ``cluster/request_migration.py`` with each copy a real one between processes (the commands
in ``actor.py``): the source reads the request's computed blocks ``[clean, total)`` while it keeps decoding
(``migrate_copy``: one ``ray.put``), the destination reserves blocks and writes the copy into them
(``migrate_reserve``); a stage repeats for the blocks dirtied meanwhile until at most
``last_stage_max_blocks`` are left (or aborts after ``max_stages``), then the source detaches the request at
its next step boundary and sends the last blocks with its state (``migrate_stop``), the destination admits
it over the reserved blocks (``migrate_commit``; the pause is stop -> commit), and the source frees its held
blocks (``release``). A request that finishes, is aborted or is preempted on the source aborts the move
(the destination's reservation goes); so does a destination short of blocks, or a dead instance (then the
request is failed or stays, by where it lives). Pairing is the simulator's own: ``cluster.llumnix.
LlumnixController.pairs`` over the actors' loads, every ``pair_interval_s``; the source picks the request
(``choose_request``, ``request_policy``). The log feeds ``summarize_migrations``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from kvbalance.cluster.llumnix import LlumnixController, LlumnixSection
from kvbalance.cluster.request_migration import summarize_migrations

COPY, RESERVE, STOP, COMMIT, DONE = "copy", "reserve", "stop", "commit", "done"


@dataclass
class Move:
    """One request's move from instance ``src`` to ``dst`` (indexes into the backend's instances)."""

    src: int
    dst: int
    start_s: float
    rid: str | None = None  # None until the source chose it
    clean: int = 0  # blocks [0, clean) copied and full
    stages: int = 0
    preemptions: int | None = None  # the request's preemption count at the first copy
    state: str = COPY
    stop_s: float | None = None
    end_s: float | None = None
    outcome: str | None = None  # "committed" or the abort reason
    recomputed: bool = False  # committed, but the last blocks did not fit: the destination recomputes it
    bytes_moved: float = 0.0

    @property
    def pause_s(self) -> float:
        return (self.end_s - self.stop_s) if self.outcome == "committed" else 0.0


class LiveMigrations:
    """Moves in flight and their log. ``send(index, command)`` queues a command for an instance's next step;
    ``now()`` is the front end's clock; ``rehome(rid, index)`` moves a request's home at the stop."""

    def __init__(self, backend, section: LlumnixSection | None = None, *, block_bytes: int = 0) -> None:
        self.backend = backend
        self.section = section or LlumnixSection()
        self.block_bytes = block_bytes
        self.active: dict[int, Move] = {}  # source index -> its move
        self.busy: set[int] = set()
        self.log: list[Move] = []
        self._shim = SimpleNamespace(members=[], load=None, block_size=1)
        self._controller: LlumnixController | None = None
        self._last_tick_s: float | None = None

    # -- starting ------------------------------------------------------------------------------
    def start(self, src: int, dst: int, rid: str | None = None) -> Move | None:
        """Begin moving ``rid`` (or the request the source's policy picks) from ``src`` to ``dst``."""
        if src == dst or src in self.busy or dst in self.busy:
            return None
        mv = Move(src, dst, self.backend.now(), rid)
        self.active[src] = mv
        self.busy.update((src, dst))
        self.log.append(mv)
        self.backend.send(src, ("migrate_copy", rid, 0, self.section.request_policy, None))
        return mv

    def tick(self, loads: dict[int, object], block_size: int) -> None:
        """Llumnix's pairing round over the live colocated instances' loads (index -> InstanceLoad)."""
        now = self.backend.now()
        if self._last_tick_s is not None and now - self._last_tick_s < self.section.pair_interval_s:
            return
        self._last_tick_s = now
        shim = self._shim
        shim.members = [SimpleNamespace(index=i, role="colocated") for i in sorted(loads)]
        shim.load = lambda m: loads[m.index]
        shim.block_size = block_size
        if self._controller is None:
            self._controller = LlumnixController(shim, self.section)
        ctrl = self._controller
        for m in shim.members:
            ctrl._preemptions.setdefault(m.index, 0)
        ctrl.migrator.busy = self.busy
        for src, dst in ctrl.pairs():
            self.start(src.index, dst.index)

    # -- replies --------------------------------------------------------------------------------
    def on_reply(self, index: int, reply: tuple) -> None:
        kind = reply[0]
        if kind == "none":
            mv = self.active.get(index)
            if mv is not None and mv.rid is None:
                self.log.remove(mv)  # nothing to move there: no migration happened
                self._end(mv, "no_request")
            return
        rid = reply[1]
        mv = self._find(rid, index)
        if mv is None:
            return
        b = self.backend
        if kind == "copied":
            _, _, kv, first, total, new_clean, preemptions = reply
            mv.rid = rid
            if mv.preemptions is None:
                mv.preemptions = preemptions
            mv.stages += 1
            mv.clean = new_clean
            mv.bytes_moved += (total - first) * self.block_bytes
            mv.state = RESERVE
            b.send(mv.dst, ("migrate_reserve", rid, first, total, kv))
        elif kind == "reserved":
            sec = self.section
            # Llumnix: stop-and-copy once few enough blocks are dirty (the source keeps decoding meanwhile)
            dirty = b.request_blocks(rid) - mv.clean
            if dirty <= sec.last_stage_max_blocks:
                mv.state = STOP
                b.send(mv.src, ("migrate_stop", rid, mv.clean, mv.preemptions))
            elif mv.stages >= sec.max_stages:
                self._abort(mv, "not_converged")
            else:
                mv.state = COPY
                b.send(mv.src, ("migrate_copy", rid, mv.clean, sec.request_policy, mv.preemptions))
        elif kind == "reserve_failed":
            self._abort(mv, "dst_out_of_blocks")
        elif kind == "gone":
            self._abort(mv, reply[2])
        elif kind == "stopped":
            _, _, kv, first, total, state = reply
            mv.stop_s = b.now()
            mv.bytes_moved += (total - first) * self.block_bytes
            mv.state = COMMIT
            b.rehome(rid, mv.dst)
            b.send(mv.dst, ("migrate_commit", rid, first, total, kv, state))
        elif kind == "committed":
            b.send(mv.src, ("release", rid))
            mv.recomputed = bool(reply[2])
            self._end(mv, "committed")

    def _find(self, rid: str, index: int) -> Move | None:
        for mv in self.active.values():
            if mv.rid == rid or (mv.rid is None and mv.src == index):
                return mv
        return None

    def _abort(self, mv: Move, reason: str) -> None:
        """No copy in flight: the destination's reservation goes; the request stays on the source."""
        if self.backend.alive(mv.dst) and mv.rid is not None:
            self.backend.send(mv.dst, ("migrate_cancel", mv.rid))
        self._end(mv, reason)

    def _end(self, mv: Move, outcome: str) -> None:
        mv.state, mv.outcome, mv.end_s = DONE, outcome, self.backend.now()
        self.active.pop(mv.src, None)
        self.busy.difference_update((mv.src, mv.dst))

    # -- faults ---------------------------------------------------------------------------------
    def on_death(self, index: int) -> None:
        """Instance ``index`` died: end the moves it takes part in, freeing what the other side holds."""
        for mv in list(self.active.values()):
            if index not in (mv.src, mv.dst):
                continue
            if mv.state == COMMIT:
                # the request was detached from the source and lives on the destination now
                if index == mv.dst:
                    self.backend.send(mv.src, ("release", mv.rid))  # it died with the destination
                    self._end(mv, "dst_died")
                # a dead source: the destination's commit reply still ends the move
            elif index == mv.src:
                self._abort(mv, "src_died")
            else:
                self._end(mv, "dst_died")  # the request stays on the source

    def summary(self) -> dict:
        return summarize_migrations(self.log)
