"""Workloads that reuse KV across requests: shared documents with many questions, multi-turn conversations.

These are the loads a global KV store and cache-aware routing are built for (BanaServe's premise):

- ``docqa:D:K:A-B:C-D[:S]`` (LongBench-style question answering over shared documents): ``D`` documents of
  ``K`` tokens each; every request is one document followed by a unique question of ``A..B`` tokens, with an
  answer of ``C..D`` tokens. Document popularity is Zipf with exponent ``S`` (P(doc d) ~ (d + 1)^-S, d = 0 the
  most popular; ``S = 0``, the default, is uniform). Requests on the same document share exactly its ``K``
  leading tokens; different documents share nothing.
- ``chat:T:A-B:C-D:G:W`` (synthetic multi-turn conversations, Mooncake-like): a session has a geometric
  number of turns with mean ``T``, ended early when the next turn would not fit the context; sessions start
  at ``rate`` over the mean turns per session left after that cap (the arrival process times session
  starts, so ``rate`` stays requests per second), from well before time 0 so the load is steady from 0 on; turn k's prompt is the ``G``-token system prompt every session shares (rounded up to whole
  16-token blocks), then every earlier turn's user message and answer, then a new user message of
  ``A..B`` tokens; its answer has ``C..D`` tokens; turns of a session are exponential gaps of mean ``W``
  seconds apart. So turn k + 1 shares turn k's whole prompt (the answer between them is the model's own
  output: in simulation its tokens are stand-ins, so a cache hit covers the earlier prompt, as on a trace).

Named presets (``PRESETS``) spell out the parameters the cluster experiments use. Same arguments, same
requests: every draw comes from generators spawned from the seed. ``Request.meta`` keeps ``doc`` (docqa) or
``session`` and ``turn`` (chat) for reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvbalance.request import Request, SamplingParams
from kvbalance.workloads.arrivals import arrival_times
from kvbalance.workloads.lengths import JointLengths, PairedLengths, Uniform
from kvbalance.workloads.tokens import SyntheticPrompt, shared_prefix_prompt

KINDS = ("docqa", "chat")
# name -> the workload string it stands for (documented in the module docstring and docs/reproductions.md)
PRESETS = {
    # 64 documents of 1,536 tokens (LongBench-style contexts cut to a 2,048-token model), hot documents
    "docqa-zipf": "docqa:64:1536:16-64:16-128:1.2",
    "docqa-uniform": "docqa:64:1536:16-64:16-128:0",
    # 320 documents: 0.49M tokens of context (0.40 TB for a 13B model), more than 8 A100-80GB's KV caches
    # hold (~0.45M tokens, shared with the running requests), less than the global store's 512 GB
    "docqa-large": "docqa:320:1536:16-64:16-128:0.6",
    # 256-token shared system prompt, 4 turns on average, 30 s between turns
    "chat": "chat:4:32-256:64-320:256:30",
}
CHAT_BLOCK_TOKENS = 16  # granularity of a conversation's token identities
_SESSION_BLOCKS = 1 << 17  # identities per session (2M tokens); system prompt identities sit below the first
_MAX_SYSTEM_BLOCKS = _SESSION_BLOCKS


@dataclass(frozen=True)
class DocQA:
    num_docs: int
    doc_tokens: int
    question: tuple[int, int]
    output: tuple[int, int]
    zipf_s: float = 0.0

    def popularity(self) -> np.ndarray:
        w = np.arange(1, self.num_docs + 1, dtype=np.float64) ** -self.zipf_s
        return w / w.sum()


@dataclass(frozen=True)
class Chat:
    mean_turns: int
    user: tuple[int, int]
    answer: tuple[int, int]
    system_tokens: int
    think_s: float


def _int(workload: str, text: str, what: str, minimum: int) -> int:
    try:
        v = int(text)
    except ValueError:
        v = minimum - 1
    if v < minimum:
        raise ValueError(f"workload: {what} in {workload!r} must be an int >= {minimum}, got {text!r}")
    return v


def _float(workload: str, text: str, what: str, positive: bool) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"workload: {what} in {workload!r} must be a number {bound}, got {text!r}")
    return v


def _span(workload: str, text: str, what: str) -> tuple[int, int]:
    parts = text.split("-")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, -1)
    except ValueError:
        lo, hi = 0, -1
    if not 1 <= lo <= hi:
        raise ValueError(f"workload: {what} in {workload!r} must be N or A-B with 1 <= A <= B, got {text!r}")
    return lo, hi


def parse(workload: str) -> DocQA | Chat:
    """The options of a ``docqa``/``chat`` string or a preset name; ValueError naming ``workload`` else."""
    kind, _, rest = PRESETS.get(workload, workload).partition(":")
    parts = rest.split(":") if rest else []
    if kind == "docqa":
        if len(parts) not in (4, 5):
            raise ValueError(f"workload: expected 'docqa:D:K:A-B:C-D[:S]', got {workload!r}")
        s = _float(workload, parts[4], "Zipf exponent", positive=False) if len(parts) == 5 else 0.0
        return DocQA(
            _int(workload, parts[0], "documents", 1),
            _int(workload, parts[1], "document tokens", 1),
            _span(workload, parts[2], "question"),
            _span(workload, parts[3], "output"),
            s,
        )
    if kind == "chat":
        if len(parts) != 5:
            raise ValueError(f"workload: expected 'chat:T:A-B:C-D:G:W', got {workload!r}")
        system = _int(workload, parts[3], "system prompt tokens", 0)
        if system > _MAX_SYSTEM_BLOCKS * CHAT_BLOCK_TOKENS:
            raise ValueError(f"workload: system prompt tokens in {workload!r} must be <= 2097152")
        return Chat(
            _int(workload, parts[0], "mean turns", 1),
            _span(workload, parts[1], "user message"),
            _span(workload, parts[2], "answer"),
            system,
            _float(workload, parts[4], "seconds between turns", positive=True),
        )
    raise ValueError(f"workload: {workload!r} is not a docqa or chat workload")


def _check_fits(workload: str, longest_prompt: int, shortest_output: int, max_context: int) -> None:
    if longest_prompt + shortest_output > max_context:
        raise ValueError(
            f"workload: {workload!r} has prompts up to {longest_prompt} tokens, which with an answer of "
            f"{shortest_output} do not fit the {max_context}-token context"
        )


def _request(index: int, prompt: SyntheticPrompt, output_len: int, arrival_s: float, **meta) -> Request:
    req = Request(
        f"r{index:06d}",
        prompt,
        SamplingParams(max_tokens=int(output_len), ignore_eos=True),
        arrival_s=arrival_s,
    )
    req.meta.update(meta)
    return req


def lengths(opts: DocQA | Chat, max_context: int) -> JointLengths | PairedLengths:
    """The (input, output) length model: exact for docqa, a seeded sample of 4,096 requests for chat."""
    if isinstance(opts, DocQA):
        inp = Uniform(opts.doc_tokens + opts.question[0], opts.doc_tokens + opts.question[1])
        return JointLengths(inp, Uniform(*opts.output), max_context, truncate="output")
    reqs = _chat(opts, "chat", 4096, 1.0, 0, max_context, "poisson", 1.0, 0)
    return PairedLengths([r.num_prompt_tokens for r in reqs], [r.max_tokens for r in reqs])


def build(
    opts: DocQA | Chat, workload: str, num_requests: int, rate: float, seed: int, max_context: int,
    arrival: str = "poisson", cv: float = 1.0, uid_offset: int = 0,
) -> list[Request]:  # fmt: skip
    """``num_requests`` requests of the workload, sorted by arrival, ids ``r000000``, ..."""
    if isinstance(opts, DocQA):
        return _docqa(opts, workload, num_requests, rate, seed, max_context, arrival, cv, uid_offset)
    return _chat(opts, workload, num_requests, rate, seed, max_context, arrival, cv, uid_offset)


def _docqa(o: DocQA, workload, n, rate, seed, cap, arrival, cv, uid_offset) -> list[Request]:
    _check_fits(workload, o.doc_tokens + o.question[0], o.output[0], cap)
    len_rng, arr_rng, doc_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    inputs, outputs = lengths(o, cap).sample(len_rng, n)
    times = arrival_times(arrival, rate, n, arr_rng, cv)
    docs = doc_rng.choice(o.num_docs, size=n, p=o.popularity())
    out = []
    for i, (d, s, out_len, t) in enumerate(zip(docs, inputs, outputs, times)):
        prompt = shared_prefix_prompt(int(d), o.doc_tokens, int(s) - o.doc_tokens, uid_offset + i)
        out.append(_request(i, prompt, int(out_len), float(t), doc=int(d)))
    return out


def _session(o: Chat, system: int, cap: int, turn_rng, len_rng) -> list[tuple[float, int, int]]:
    """One session's turns: (offset from its start s, prompt tokens, answer tokens)."""
    out, context, t = [], system, 0.0
    while True:
        user = int(len_rng.integers(o.user[0], o.user[1] + 1))
        answer = int(len_rng.integers(o.answer[0], o.answer[1] + 1))
        prompt = context + user
        if prompt + min(answer, o.answer[0]) > cap:
            return out
        out.append((t, prompt, min(answer, cap - prompt)))
        context = prompt + answer
        if turn_rng.random() < 1.0 / o.mean_turns:  # geometric number of turns, mean T
            return out
        t += float(turn_rng.exponential(o.think_s))


def turns_per_session(o: Chat, max_context: int, sessions: int = 2000) -> float:
    """Mean turns of a session once the context cap ends some early (a fixed-seed estimate)."""
    system = -(-o.system_tokens // CHAT_BLOCK_TOKENS) * CHAT_BLOCK_TOKENS
    turn_rng, len_rng = np.random.default_rng(1), np.random.default_rng(2)
    return sum(len(_session(o, system, max_context, turn_rng, len_rng)) for _ in range(sessions)) / sessions


def _chat(o: Chat, workload, n, rate, seed, cap, arrival, cv, uid_offset) -> list[Request]:
    """Sessions start at ``rate / (turns per session)`` from ``-warm_s`` on, so that at time 0 the load is
    already in steady state (turns of sessions begun earlier arrive too); requests before 0 are dropped."""
    bt = CHAT_BLOCK_TOKENS
    system = -(-o.system_tokens // bt) * bt
    _check_fits(workload, system + o.user[0], o.answer[0], cap)
    start_rng, turn_rng, len_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    session_rate = rate / max(turns_per_session(o, cap), 1.0)
    warm_s = 0.0 if math.isinf(rate) else 4.0 * o.think_s * o.mean_turns
    sys_ids = np.arange(system // bt, dtype=np.int64)
    turns: list[tuple[float, int, int, int, int]] = []  # (arrival, session, turn, prompt tokens, answer)
    last_start, sessions, chunk = -warm_s, 0, max(16, n // o.mean_turns + 1)
    while True:
        starts = last_start + arrival_times(arrival, session_rate, chunk + 1, start_rng, cv)
        starts = starts[:-1] if sessions == 0 else starts[1:]
        for t0 in starts:
            for k, (dt, prompt, answer) in enumerate(_session(o, system, cap, turn_rng, len_rng)):
                if t0 + dt >= 0:
                    turns.append((float(t0 + dt), sessions, k, prompt, answer))
            sessions += 1
        last_start = float(starts[-1]) if len(starts) else last_start
        # every request arriving by the latest session start is final (later sessions start later)
        ready = len(turns) if math.isinf(rate) else sum(1 for a, *_ in turns if a <= last_start)
        if ready >= n:
            break
    turns.sort()
    out = []
    for i, (t, s, k, prompt, answer) in enumerate(turns[:n]):
        ids = np.concatenate(
            (sys_ids, _MAX_SYSTEM_BLOCKS + s * _SESSION_BLOCKS + np.arange(-(-(prompt - system) // bt)))
        )
        p = SyntheticPrompt(prompt, uid_offset + i, ids, bt)
        out.append(_request(i, p, answer, t, session=s, turn=k))
    return out
