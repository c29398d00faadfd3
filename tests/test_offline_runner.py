"""Real-engine Batch runs over the tiny random model: one output line per input line in input order,
greedy outputs independent of the plan order, and a crashed run resumed without losses or duplicates."""

from __future__ import annotations

import json
import random
import warnings

import pytest

pytest.importorskip("torch")

from kvbalance.cli import main  # noqa: E402
from kvbalance.llm import LLMEngine  # noqa: E402
from kvbalance.offline.batch_worker import LocalBackend  # noqa: E402
from kvbalance.offline.runner import run_batch  # noqa: E402
from kvbalance.request import SamplingParams  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::Warning")


class CharTokenizer:
    """One id per character (vocab 256), printable ASCII on the way back, a toy chat template."""

    eos_token_id = None
    chat_template = "<role>content..."

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x20 + int(i) % 95) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


def make_engine() -> LLMEngine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = LLMEngine("tiny-llama", kv_cache_tokens=4096, max_num_batched_tokens=64, num_threads=1)
    eng.tokenizer = CharTokenizer()
    return eng


def _req(cid: str, url: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def job_lines() -> list[str]:
    """Greedy requests sharing prefixes (text, token ids, chat), with bad lines between them."""
    rng = random.Random(7)
    shared = "You are a careful assistant. Answer briefly. "
    lines = []
    for i in range(8):
        prompt = shared + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(3, 40)))
        lines.append(
            _req(f"t{i}", "/v1/completions", prompt=prompt, max_tokens=rng.randint(2, 9), temperature=0)
        )
    for i in range(4):
        ids = [rng.randrange(256) for _ in range(rng.randint(5, 70))]
        lines.append(_req(f"ids{i}", "/v1/completions", prompt=ids, max_tokens=6, temperature=0))
    for i in range(3):
        msgs = [{"role": "system", "content": shared}, {"role": "user", "content": f"question {i}?"}]
        lines.append(_req(f"chat{i}", "/v1/chat/completions", messages=msgs, max_tokens=5, temperature=0))
    bad = [
        "{oops",
        _req("long", "/v1/completions", prompt="x" * 600, max_tokens=4),
        _req("neg", "/v1/completions", prompt="x", max_tokens=-1),
        json.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/completions"}),
        _req("t3", "/v1/completions", prompt="duplicate id"),
        _req("stop", "/v1/completions", prompt=shared, max_tokens=8, temperature=0, stop=["%"]),
    ]
    for k, b in enumerate(bad):
        lines.insert(2 + 3 * k, b)
    return lines


@pytest.fixture
def job(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(job_lines()) + "\n")
    return path


def read_out(path) -> list[dict]:
    return [json.loads(s) for s in open(path).read().splitlines()]


def comparable(records: list[dict]) -> list[dict]:
    """Output lines without the wall-clock ``created`` stamp."""
    out = []
    for r in records:
        r = json.loads(json.dumps(r))
        body = (r.get("response") or {}).get("body") or {}
        body.pop("created", None)
        out.append(r)
    return out


class Planner:
    """A planner object that feeds the engine in a fixed permutation of the input."""

    def __init__(self, how: str) -> None:
        self.how, self.name = how, how

    def plan(self, requests, ctx):
        order = list(range(len(requests)))
        if self.how == "reverse":
            order.reverse()
        else:
            random.Random(3).shuffle(order)
        return type("Plan", (), {"order": order, "ranks": lambda self, n: [order[k::n] for k in range(n)]})()


def test_bad_lines_get_one_output_line_each_in_place(job, tmp_path):
    out = tmp_path / "out.jsonl"
    s = run_batch(job, out, LocalBackend(make_engine(), "tiny-llama"), progress=False)
    lines = job.read_text().splitlines()
    records = read_out(out)
    assert len(records) == len(lines) == s.num_lines
    for text, rec in zip(lines, records):
        try:
            cid = json.loads(text).get("custom_id")
        except json.JSONDecodeError:
            cid = None
        assert rec["custom_id"] == cid
    by_kind = {}
    for rec in records:
        kind = "error" if rec["error"] else rec["response"]["status_code"]
        by_kind[kind] = by_kind.get(kind, 0) + 1
    assert by_kind == {200: 16, 400: 2, "error": 3}
    assert (s.num_generated, s.num_refused, s.num_line_errors) == (16, 2, 3)
    ctx_err = next(r for r in records if r["custom_id"] == "long")["response"]["body"]["error"]
    assert ctx_err["param"] == "prompt" and "context_length" in ctx_err["message"]
    stop = next(r for r in records if r["custom_id"] == "stop")["response"]["body"]["choices"][0]
    assert "%" not in stop["text"]
    chat = next(r for r in records if r["custom_id"] == "chat0")["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 5
    assert not (tmp_path / "out.jsonl.partial").exists()


def reference_tokens(job) -> dict[str, list[int]]:
    """The same requests fed one by one in input order (FCFS) straight into an engine."""
    eng = make_engine()
    reqs = {}
    for text in job.read_text().splitlines():
        try:
            obj = json.loads(text)
            body = obj["body"]
        except (json.JSONDecodeError, KeyError):
            continue
        if (
            body.get("max_tokens", 1) < 1
            or len(str(body.get("prompt", ""))) > 500
            or obj["custom_id"] in reqs
        ):
            continue
        ids = eng.chat_prompt(body["messages"]) if "messages" in body else eng.encode(body["prompt"])
        params = SamplingParams(max_tokens=body["max_tokens"], stop=body.get("stop", []))
        reqs[obj["custom_id"]] = eng.add_request(ids, params)
    while eng.has_unfinished():
        eng.step()
    return {cid: r.output_token_ids for cid, r in reqs.items()}


@pytest.mark.parametrize("how", ["reverse", "shuffle"])
def test_outputs_equal_fcfs_whatever_the_plan_order(job, tmp_path, how):
    run_batch(job, tmp_path / "fcfs.jsonl", LocalBackend(make_engine()), progress=False)
    eng, fed = make_engine(), []
    add = eng.add_request
    eng.add_request = lambda ids, params, rid: fed.append(int(rid.split("-")[1])) or add(ids, params, rid)
    run_batch(job, tmp_path / "plan.jsonl", LocalBackend(eng), planner=Planner(how), progress=False)
    fcfs_indices = sorted(fed)
    assert fed == [fcfs_indices[i] for i in Planner(how).plan(fed, None).order]  # the engine saw the plan
    fcfs, planned = read_out(tmp_path / "fcfs.jsonl"), read_out(tmp_path / "plan.jsonl")
    assert comparable(planned) == comparable(fcfs)
    tokens = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"]
        for r in fcfs
        if r["response"] and r["response"]["status_code"] == 200
    }
    ref = reference_tokens(job)
    assert tokens == ref
    assert len({tuple(t) for t in tokens.values()}) > 4  # outputs differ between requests: a real check


class CrashAfter(LocalBackend):
    """Dies (like a killed process) after ``k`` finished requests have been handed to the writer."""

    def __init__(self, engine, k: int) -> None:
        super().__init__(engine)
        self.k = k

    def generate(self, shards):
        n = 0
        for batch in super().generate(shards):
            take = batch[: self.k - n]
            n += len(take)
            if take:
                yield take
            if n >= self.k:
                raise KeyboardInterrupt("simulated crash")


@pytest.mark.parametrize("k", [1, 7])
def test_resumed_run_completes_without_duplicates_or_losses(job, tmp_path, k):
    out = tmp_path / "out.jsonl"
    run_batch(job, tmp_path / "whole.jsonl", LocalBackend(make_engine()), progress=False)
    with pytest.raises(KeyboardInterrupt):
        run_batch(job, out, CrashAfter(make_engine(), k), progress=False)
    journal = tmp_path / "out.jsonl.partial"
    assert not out.exists() and len(journal.read_text().splitlines()) == 1 + k
    with open(journal, "a") as fh:
        fh.write('{"i": 0, "crc": 1, "record": {"id": "torn')  # a write cut short by the crash
    s = run_batch(job, out, LocalBackend(make_engine()), progress=False)
    assert (s.num_resumed, s.num_generated, s.dropped_journal_lines) == (k, 16 - k, 1)
    records = read_out(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == len(job.read_text().splitlines())
    assert comparable(records) == comparable(read_out(tmp_path / "whole.jsonl"))
    assert not journal.exists()
    again = run_batch(job, out, LocalBackend(make_engine()), progress=False)
    assert again.already_complete and again.num_generated == 0
    assert read_out(out) == records


def test_cli_batch_run_token_id_prompts(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    lines = [
        _req(f"r{i}", "/v1/completions", prompt=[i + 1, 2, 3], max_tokens=3, temperature=0) for i in range(3)
    ]
    path.write_text("\n".join([*lines, "not json"]) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["offline", "run", str(path), "--output", str(out), "--model", "tiny-llama", "--no-progress"]
    argv += ["--kv-cache-tokens", "1024", "--num-threads", "1"]
    assert main(argv) == 0
    assert "4 lines: 3 generated, 0 resumed, 0 refused (4xx), 1 invalid lines" in capsys.readouterr().out
    records = read_out(out)
    assert [r["custom_id"] for r in records] == ["r0", "r1", "r2", None]
    assert all(len(r["response"]["body"]["choices"][0]["token_ids"]) == 3 for r in records[:3])
    assert main(argv) == 0 and "already complete" in capsys.readouterr().out
    assert main(["offline", "run", str(tmp_path / "nope.jsonl"), "--output", str(out)]) == 2
    assert main(["offline", "run", str(path), "--model", "tiny-llama"]) == 2
    assert "output" in capsys.readouterr().err
    assert main([*argv, "--planner", "nope"]) == 2
    assert "planner: unknown 'nope'" in capsys.readouterr().err


def test_warmup_samples_are_real_outputs_and_not_generated_again(job, tmp_path):
    plan_mod = pytest.importorskip("kvbalance.offline.plan")
    seen = {}

    class Sampling:
        name = "sampling"

        def plan(self, requests, ctx):
            seen["lengths"] = list(ctx.run_samples([0, 3, 5]))
            seen["budgets"] = [requests[i].max_tokens for i in (0, 3, 5)]
            return plan_mod.OfflinePlan(self.name, list(range(len(requests)))[::-1], warmup=[0, 3, 5])

    run_batch(job, tmp_path / "fcfs.jsonl", LocalBackend(make_engine()), progress=False)
    s = run_batch(
        job, tmp_path / "out.jsonl", LocalBackend(make_engine()), planner=Sampling(), progress=False
    )
    assert s.num_generated == 16  # the three samples once, the rest once
    assert seen["lengths"] == seen["budgets"]  # greedy, no EOS: every sample runs to its budget
    assert comparable(read_out(tmp_path / "out.jsonl")) == comparable(read_out(tmp_path / "fcfs.jsonl"))


def _run_greedy_chats_and_completions(llm, msgs: list, prompts: list[str], tmp_path) -> list[dict]:
    """A Batch file of a greedy 12-token chat per message list, then a completion per prompt, run through
    ``llm``'s engine; the output records in input order."""
    lines = [
        _req(f"chat{i}", "/v1/chat/completions", messages=m, max_tokens=12, temperature=0)
        for i, m in enumerate(msgs)
    ]
    lines += [
        _req(f"cmpl{i}", "/v1/completions", prompt=p, max_tokens=12, temperature=0)
        for i, p in enumerate(prompts)
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    run_batch(tmp_path / "in.jsonl", tmp_path / "out.jsonl", LocalBackend(llm.engine), progress=False)
    return read_out(tmp_path / "out.jsonl")


@pytest.mark.slow
def test_smollm2_batch_text_equals_offline_llm(tmp_path):
    from kvbalance.llm import LLM

    msgs = [[{"role": "user", "content": f"Name one fact about {c}."}] for c in ("Japan", "Peru")]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    llm = LLM("smollm2-135m", kv_cache_tokens=4096, num_threads=2)
    records = _run_greedy_chats_and_completions(llm, msgs, prompts, tmp_path)
    greedy = SamplingParams(max_tokens=12)
    want = [llm.chat(m, greedy)[0].text for m in msgs] + [o.text for o in llm.generate(prompts, greedy)]
    got = [r["response"]["body"]["choices"][0] for r in records]
    assert [c["message"]["content"] for c in got[:2]] + [c["text"] for c in got[2:]] == want
    assert all(w.strip() for w in want)


def test_run_flags_join_a_parent_command_that_has_its_own_model_and_planner():
    import argparse

    from kvbalance.offline.runner import add_run_arguments, engine_spec

    parent = argparse.ArgumentParser()
    parent.add_argument("input")
    parent.add_argument("--simulate", action="store_true")
    parent.add_argument("--model", default=None)
    parent.add_argument("--planner", default="blendserve")
    add_run_arguments(parent, positional_input=False)
    args = parent.parse_args(["job.jsonl", "--output", "o.jsonl", "--data-parallel", "2"])
    assert (args.input, args.model, args.planner, args.output, args.data_parallel) == (
        "job.jsonl",
        None,
        "blendserve",
        "o.jsonl",
        2,
    )
    assert engine_spec(args).model == "smollm2-135m"


def test_run_command_fills_in_flags_a_parent_command_never_defined(tmp_path, capsys):
    from argparse import Namespace

    from kvbalance.offline.runner import run_command

    path = tmp_path / "in.jsonl"
    path.write_text(_req("r0", "/v1/completions", prompt=[1, 2, 3], max_tokens=2, temperature=0) + "\n")
    args = Namespace(input=str(path), output=str(tmp_path / "o.jsonl"), model="tiny-llama", planner="fcfs")
    assert run_command(args) == 0
    assert "1 lines: 1 generated" in capsys.readouterr().out


def test_request_the_engine_drops_mid_run_still_gets_a_line(job, tmp_path):
    eng = make_engine()
    step = eng.step

    def step_and_drop_one():
        if "batch-0" in eng.requests:
            eng.abort("batch-0")  # gone without an output, as a failed replica would leave it
        return step()

    eng.step = step_and_drop_one
    s = run_batch(job, tmp_path / "out.jsonl", LocalBackend(eng), progress=False)
    first = read_out(tmp_path / "out.jsonl")[0]
    assert first["custom_id"] == "t0" and first["response"]["status_code"] == 500
    assert first["response"]["body"]["error"]["message"].startswith("engine: ")
    assert s.num_generated == 16 and s.num_lines == len(job.read_text().splitlines())


def test_progress_goes_to_a_log_as_lines_when_stderr_is_not_a_terminal(job, tmp_path, capsys):
    run_batch(job, tmp_path / "out.jsonl", LocalBackend(make_engine()), progress=True, progress_every=5)
    err = capsys.readouterr().err.splitlines()
    lines = [s for s in err if s.startswith("batch: ")]
    assert lines[0].startswith("batch: ") and "/21 lines started" in lines[0]  # bad lines are answered first
    counts = [int(s.split()[1].split("/")[0]) for s in lines]
    assert counts == sorted(counts) and counts[-1] == 21 and "done" in lines[-1]
    assert len(lines) >= 4  # a line per 5 answered lines (several may land in one step), then the last
    assert all("lines/s" in s for s in lines)


def test_cli_run_announces_the_model_load_before_the_first_line(tmp_path, capsys):
    path = tmp_path / "in.jsonl"
    path.write_text(_req("r0", "/v1/completions", prompt=[1, 2, 3], max_tokens=2, temperature=0) + "\n")
    argv = ["offline", "run", str(path), "--output", str(tmp_path / "out.jsonl"), "--model", "tiny-llama"]
    assert main([*argv, "--kv-cache-tokens", "1024", "--num-threads", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvbalance offline: loading tiny-llama")
    assert err[1].startswith("kvbalance offline: model loaded in ")
    assert err[2].startswith("batch: 0/1 lines started") and "done" in err[-1]
    assert main([*argv, "--progress-every", "0"]) == 2
    assert "progress-every: must be >= 1" in capsys.readouterr().err


def test_greedy_answers_in_a_batch_equal_each_prompt_run_alone(job, tmp_path):
    """The batch runner's greedy tokens equal the same prompt run alone on a fresh engine (no other request
    in its steps, nothing in its prefix cache): the kernels are batch-invariant (each output row is summed
    in the same order whatever the rows beside it), so neither the batch nor the chunking changes a token."""
    run_batch(job, tmp_path / "out.jsonl", LocalBackend(make_engine()), progress=False)
    got = {
        r["custom_id"]: r["response"]["body"]["choices"][0]["token_ids"]
        for r in read_out(tmp_path / "out.jsonl")
        if r["response"] and r["response"]["status_code"] == 200
    }
    alone = {}
    for text in job.read_text().splitlines():
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            continue
        if obj.get("custom_id") not in got or obj["custom_id"] in alone:
            continue
        eng, body = make_engine(), obj["body"]
        ids = eng.chat_prompt(body["messages"]) if "messages" in body else eng.encode(body["prompt"])
        req = eng.add_request(ids, SamplingParams(max_tokens=body["max_tokens"], stop=body.get("stop", [])))
        while eng.has_unfinished():
            eng.step()
        alone[obj["custom_id"]] = req.output_token_ids
    assert len(alone) == len(got) == 16
    assert alone == got


@pytest.mark.slow
def test_smollm2_batch_greedy_answers_equal_each_prompt_run_alone(tmp_path):
    """The issue's check on real weights: 24 greedy requests (chat and completions, shared chat template)
    through the batch runner equal each prompt run alone on an engine without a prefix cache."""
    from kvbalance.llm import LLM

    topics = (
        "Japan",
        "Peru",
        "iron",
        "owls",
        "tea",
        "Mars",
        "jazz",
        "chess",
        "salt",
        "rain",
        "glass",
        "bees",
    )
    msgs = [[{"role": "user", "content": f"Name one fact about {t}."}] for t in topics]
    prompts = [f"A short note on {t}:" for t in topics]
    llm = LLM("smollm2-135m", kv_cache_tokens=8192, num_threads=2)
    records = _run_greedy_chats_and_completions(llm, msgs, prompts, tmp_path)
    got = [r["response"]["body"]["choices"][0]["token_ids"] for r in records]
    alone_llm = LLM("smollm2-135m", kv_cache_tokens=8192, num_threads=2, enable_prefix_caching=False)
    greedy = SamplingParams(max_tokens=12)
    want = [alone_llm.chat(m, greedy)[0].token_ids for m in msgs]
    want += [alone_llm.generate([p], greedy)[0].token_ids for p in prompts]
    assert got == want
