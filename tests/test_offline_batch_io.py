"""OpenAI Batch files: every input line is parsed into a request, a 4xx refusal or an error record (never an
exception), and the journaled output survives a torn write and refuses a journal from another job."""

from __future__ import annotations

import json

import pytest

from kvbalance.offline.batch_io import (
    BatchLineError,
    BatchRefusal,
    BatchRequest,
    ChatBody,
    line_error_record,
    parse_line,
    read_batch_input,
    refusal_record,
)
from kvbalance.offline.batch_output import BatchOutput


def _line(cid="r1", url="/v1/completions", **body) -> str:
    body.setdefault("prompt", "hi")
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_valid_completion_and_chat_lines_parse():
    item = parse_line(0, 1, _line(max_tokens=3, temperature=0, stop="x"))
    assert isinstance(item, BatchRequest)
    assert item.body.max_tokens == 3 and item.body.stop_strings == ["x"]
    chat = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ]
    }
    item = parse_line(
        1, 2, json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat})
    )
    assert isinstance(item.body, ChatBody)
    assert item.body.message_dicts() == [{"role": "user", "content": "ab"}]
    assert item.body.requested_max_tokens is None and item.body.num_logprobs is None


@pytest.mark.parametrize(
    ("text", "code", "message"),
    [
        ("{not json", "invalid_json", "line 4: not valid JSON"),
        ("[1, 2]", "invalid_request", "line 4: must be a JSON object, got list"),
        (
            json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
            "invalid_request",
            "custom_id: is required",
        ),
        (
            json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}),
            "invalid_request",
            "method: must be 'POST'",
        ),
        (
            json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions"}),
            "invalid_request",
            "body: is required",
        ),
        (
            json.dumps(
                {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}, "extra": 1}
            ),
            "invalid_request",
            "extra: is not a known field",
        ),
    ],
)
def test_lines_without_a_valid_envelope_become_error_records(text, code, message):
    item = parse_line(3, 4, text)
    assert isinstance(item, BatchLineError)
    assert item.code == code and message in item.message
    rec = line_error_record(item)
    assert rec["response"] is None and rec["error"] == {"code": code, "message": item.message}
    assert rec["custom_id"] == (json.loads(text).get("custom_id") if text.startswith('{"') else None)


@pytest.mark.parametrize(
    ("line", "status", "param", "message"),
    [
        (_line(url="/v1/embeddings"), 400, "url", "url: must be /v1/chat/completions or /v1/completions"),
        (_line(max_tokens=0), 400, "max_tokens", "max_tokens: must be >= 1, got 0"),
        (_line(temperature=-1), 400, "temperature", "temperature: must be >= 0.0, got -1"),
        (_line(top_p=1.5), 400, "top_p", "top_p: must be <= 1.0, got 1.5"),
        (_line(n=2), 400, "n", "n: must be 1, got 2"),
        (_line(stream=True), 400, "stream", "stream: must be False"),
        (_line(prompt=""), 400, "prompt", "prompt: must not be empty"),
        (_line(prompt=["a", "b"]), 400, "prompt", "prompt: must be a string or a list of token ids"),
        (_line(logprobs=21), 400, "logprobs", "logprobs: must be <= 20"),
        (_line(best_of=2), 400, "best_of", "best_of: is not a known field"),
        (_line(url="/v1/chat/completions", messages=[]), 400, "messages", "messages: "),
        (
            _line(url="/v1/chat/completions", messages=[{"role": "robot", "content": "x"}]),
            400,
            "messages[0].role",
            "",
        ),
        (_line(model="gpt-4o"), 404, "model", "model: 'gpt-4o' is not served here"),
    ],
)
def test_requests_the_api_would_refuse_get_a_4xx_response(line, status, param, message):
    if "/v1/chat" in line:
        obj = json.loads(line)
        obj["body"].pop("prompt")
        line = json.dumps(obj)
    item = parse_line(0, 1, line, served_model="tiny-llama")
    assert isinstance(item, BatchRefusal), item
    rec = refusal_record(item)
    assert rec["error"] is None and rec["custom_id"] == "r1"
    assert rec["response"]["status_code"] == status
    err = rec["response"]["body"]["error"]
    assert err["param"] == param and err["message"].startswith(message)
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_file_keeps_one_item_per_line_in_place(tmp_path):
    lines = [_line("a"), "garbage", "", _line("b", max_tokens=0), _line("a"), "   ", _line("c")]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    inp = read_batch_input(path)
    kinds = [type(it).__name__ for it in inp.items]
    assert kinds == ["BatchRequest", "BatchLineError", "BatchRefusal", "BatchLineError", "BatchRequest"]
    assert [it.index for it in inp.items] == list(range(5))
    assert [it.line_no for it in inp.items] == [1, 2, 4, 5, 7]
    assert inp.num_blank_lines == 2
    dup = inp.items[3]
    assert dup.code == "duplicate_custom_id" and "already used by line 1" in dup.message
    with pytest.raises(FileNotFoundError, match="input"):
        read_batch_input(tmp_path / "missing.jsonl")


# -- the journaled output --------------------------------------------------------------------------------
def _job(tmp_path, n=4):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(_line(f"r{i}") + "\n" for i in range(n)))
    return read_batch_input(path)


def _rec(i):
    return {"id": f"x{i}", "custom_id": f"r{i}", "response": {"status_code": 200}, "error": None}


def test_torn_journal_tail_is_cut_and_complete_lines_kept(tmp_path):
    inp = _job(tmp_path)
    out = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"})
    assert out.open().done == {}
    out.append([(2, _rec(2)), (0, _rec(0))])
    out.close()
    with open(out.journal_path, "a") as fh:
        fh.write('{"i": 1, "crc": 5, "rec')  # the crash hit mid-write
    again = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"})
    state = again.open()
    assert state.done == {0: _rec(0), 2: _rec(2)} and state.dropped_lines == 1
    again.append([(1, _rec(1))])
    again.close()
    third = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"})
    state = third.open()  # what was appended after the cut reads back whole
    assert state.done == {0: _rec(0), 1: _rec(1), 2: _rec(2)} and state.dropped_lines == 0
    third.append([(3, _rec(3))])
    third.finalize({**state.done, 3: _rec(3)})
    lines = [json.loads(s) for s in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert lines == [_rec(i) for i in range(4)]
    assert not out.journal_path.exists()
    done = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"}).open()
    assert done.complete and len(done.done) == 4


def test_journal_lines_with_bad_checksum_or_wrong_request_are_redone(tmp_path):
    inp = _job(tmp_path)
    out = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"})
    out.open()
    out.append([(0, _rec(0)), (1, _rec(1))])
    out.close()
    text = out.journal_path.read_text().replace('"x1"', '"y1"')  # same length, checksum no longer matches
    out.journal_path.write_text(text + json.dumps({"i": 2, "crc": 0, "record": _rec(3)}) + "\n")
    state = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"}).open()
    assert state.done == {0: _rec(0)} and state.dropped_lines == 2


def test_journal_or_output_of_another_job_is_refused(tmp_path):
    inp = _job(tmp_path)
    out = BatchOutput(tmp_path / "out.jsonl", inp, {"model": "m"})
    out.open()
    out.close()
    with pytest.raises(ValueError, match="output: .* another job"):
        BatchOutput(tmp_path / "out.jsonl", inp, {"model": "other"}).open()
    (tmp_path / "b.jsonl").write_text(json.dumps(_rec(0)) + "\n")
    with pytest.raises(ValueError, match="output: .* not a complete output .* 1 lines for 4"):
        BatchOutput(tmp_path / "b.jsonl", inp, {"model": "m"}).open()
    with pytest.raises(ValueError, match="output: .* is the input file"):
        BatchOutput(inp.path, inp, {"model": "m"}).open()
