"""The engine: requests join and leave a running batch between rounds, stream safely, and release
everything they hold on finish, abort, error and Ctrl-C; generate() and stream() are its clients."""
from __future__ import annotations

import random

import pytest

from specflow import InputError, hookimpl
from specflow.engine import _safe_tokens

PROMPTS = ["a", "def fib(n):", "x = 1\ny = 2\n", "import os", "q", "class A:", "return x + y"]


class Holdings:
    """Counts what each stage would hold: requests started and not yet ended."""

    def __init__(self):
        self.live: set[int] = set()
        self.ends: dict[int, str] = {}

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.live.add(request.request_id)

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.live.discard(request.request_id)
        self.ends[request.request_id] = finish_reason


def drain(engine) -> dict[int, list]:
    outs: dict[int, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_requests_added_while_running_get_generate_s_outputs(make_pipeline, proposer):
    pipe = make_pipeline(f"proposer={proposer}", "max_new_tokens=12", "max_batch_size=3")
    expected = pipe.generate(PROMPTS)
    outs: dict[int, list] = {}
    with pipe.engine() as engine:
        ids = [engine.add_request(PROMPTS[0]), engine.add_request(PROMPTS[1])]
        pending = list(PROMPTS[2:])
        while engine.has_unfinished() or pending:
            if pending:                       # one new request joins every round
                ids.append(engine.add_request(pending.pop(0)))
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
    assert ids == list(range(len(PROMPTS)))
    for rid, want in enumerate(expected):
        pieces = outs[rid]
        assert [p.finished for p in pieces] == [False] * (len(pieces) - 1) + [True]
        assert "".join(p.text for p in pieces) == want.text
        assert sum((p.token_ids for p in pieces), []) == want.token_ids
        assert pieces[-1].result.token_ids == want.token_ids
        assert pieces[-1].finish_reason == want.finish_reason


def test_abort_frees_the_slot_and_every_stage_s_state(make_pipeline):
    holdings = Holdings()
    pipe = make_pipeline("proposer=draft", "max_new_tokens=30", "max_batch_size=2",
                         plugins=[holdings])
    with pipe.engine() as engine:
        running = engine.add_request("def fib(n):")
        other = engine.add_request("class A:")
        queued = engine.add_request("import os")        # no free slot yet
        engine.step()
        assert holdings.live == {running, other}
        assert engine.abort(running) is True and engine.abort(queued) is True
        assert engine.abort(12345) is False              # unknown: nothing changes
        assert engine.abort(running) is False            # aborted already
        assert holdings.live == {other} and holdings.ends[running] == "abort"
        outs = drain(engine)
    assert outs[running][-1].finish_reason == "abort" and outs[running][-1].finished
    assert outs[queued] == [outs[queued][0]] and outs[queued][0].finish_reason == "abort"
    assert queued not in holdings.ends                  # never started, nothing to release
    assert outs[other][-1].finish_reason in ("length", "eos", "stop")
    assert holdings.live == set()


def test_close_and_errors_end_every_running_request(make_pipeline):
    holdings = Holdings()

    class Boom:
        rounds = 0

        @hookimpl
        def specflow_round_end(self, result, pipeline):
            Boom.rounds += 1
            if Boom.rounds == 2:
                raise KeyboardInterrupt

    pipe = make_pipeline("max_new_tokens=30", plugins=[holdings, Boom()])
    engine = pipe.engine()
    for p in PROMPTS[:3]:
        engine.add_request(p)
    engine.step()
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert holdings.live == set() and set(holdings.ends.values()) == {"abort"}
    engine.close()
    with pytest.raises(InputError, match="closed"):
        engine.step()
    # the slots are the pipeline's again
    assert len(pipe.generate(PROMPTS[:2], max_new_tokens=4)) == 2


def test_one_engine_per_pipeline(make_pipeline):
    pipe = make_pipeline()
    with pipe.engine():
        with pytest.raises(InputError, match="already has a running engine"):
            pipe.engine()
        with pytest.raises(InputError, match="already has a running engine"):
            pipe.generate("a")
    assert pipe.generate("a", max_new_tokens=2)


def test_generate_decodes_each_result_once_not_every_round(make_pipeline):
    """generate() reads only finished results: a running row's text is not decoded each round
    (the engine's text deltas are for streaming clients), which cost a decode of the whole text
    so far per row and round."""
    pipe = make_pipeline("proposer=none", "max_new_tokens=24")
    decode, calls = pipe.tokenizer.decode, []
    pipe.tokenizer.decode = lambda ids, *a, **k: calls.append(len(ids)) or decode(ids, *a, **k)
    try:
        results = pipe.generate(PROMPTS[:2])
    finally:
        pipe.tokenizer.decode = decode
    assert all(len(r.token_ids) == 24 for r in results)
    assert len(calls) <= 2 * len(results), f"{len(calls)} decodes for {len(results)} results"


def test_stream_joins_to_generate_s_text_and_holds_back_a_forming_stop_string(make_pipeline):
    pipe = make_pipeline("proposer=ngram", "max_new_tokens=40")
    plain = pipe.generate("def fib(n):")[0]
    assert "".join(pipe.stream("def fib(n):")) == plain.text
    # a stop string taken from the middle of the plain text: the stream ends before it
    stop = plain.text[len(plain.text) // 2:][:3]
    assert len(stop) == 3
    want = pipe.generate("def fib(n):", stop=[stop])[0].text
    assert len(want) < len(plain.text) // 2 + 1
    pieces = list(pipe.stream("def fib(n):", stop=[stop]))
    assert "".join(pieces) == want and stop not in "".join(pieces)


def test_closing_a_stream_early_aborts_its_request(make_pipeline):
    holdings = Holdings()
    pipe = make_pipeline("max_new_tokens=50", plugins=[holdings])
    it = pipe.stream("def fib(n):")
    next(it)
    it.close()
    assert holdings.live == set() and list(holdings.ends.values()) == ["abort"]
    assert pipe.generate("a", max_new_tokens=2)


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("text, stops, safe", [
    ("hello wor", ["world"], 6),          # "wor" may become "world": held
    ("hello wor", ["xyz"], 9),
    ("hello w", ["w", "wx"], 6),          # "w" alone would have stopped; "wx" may still form
    ("abc", [], 3),
    ("", ["a"], 0),
])
def test_safe_tokens_hold_back_a_possible_stop_string(text, stops, safe):
    ids = [ord(c) for c in text]
    assert _safe_tokens(ids, stops, CharTokenizer().decode) == safe


class BytePieces:
    """A byte-level tokenizer's decoding with a SentencePiece habit: a token is a few bytes (a
    character may take two tokens), "_" stands for a space, and a text's first space is dropped.
    Counts the tokens it decodes."""

    def __init__(self, pieces: list[bytes]):
        self.pieces, self.decoded = pieces, 0

    def decode(self, ids):
        self.decoded += len(ids)
        text = b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")
        return text.replace("_", " ").removeprefix(" ")


def stream_rounds(tokens: list[int], tokenizer, stops: list[str], per_round: int = 2):
    """What an engine's rounds send for a row that gains `per_round` tokens a round."""
    from types import SimpleNamespace

    from specflow.engine import Engine, _Stream

    engine = Engine.__new__(Engine)
    engine.pipe = SimpleNamespace(tokenizer=tokenizer)
    request = SimpleNamespace(request_id=0, prompt_ids=[], logprobs=None)
    engine.streams = {0: _Stream(list(stops))}
    row = SimpleNamespace(request=request, token_ids=[])
    pieces = []
    for i in range(0, len(tokens), per_round):
        row.token_ids = tokens[:i + per_round]
        out = engine._delta(row, final=False)
        if out is not None:
            assert "\ufffd" not in out.text                    # never half a character
            assert out.token_ids == row.token_ids[len(sum((p.token_ids for p in pieces), [])):][
                :len(out.token_ids)]
            pieces.append(out)
    pieces.append(engine._delta(row, final=True))
    return pieces


@pytest.mark.parametrize("stops", [[], ["_stop_"], ["é!"]])
def test_a_stream_decodes_what_each_round_adds_and_joins_to_the_whole_text(stops):
    pieces = [b"_", b"a", b"b", b"_the", b"\xc3", b"\xa9", b"!", b"_stop", b"x", b"\n", b"__"]
    tok = BytePieces(pieces)
    units = [[0], [1], [2], [3], [4, 5], [6], [7], [8], [9], [10]]        # é: two tokens
    tokens = sum(random.Random(3).choices(units, k=1300), [])
    sent = stream_rounds(tokens, tok, stops)
    whole = BytePieces(pieces).decode(tokens)
    assert "".join(p.text for p in sent) == whole
    assert sum((p.token_ids for p in sent), []) == tokens
    # each round decodes a few tokens behind its new ones, not the whole text (~1400 tokens in
    # ~700 rounds: the whole text each round would be ~500,000 tokens decoded)
    assert tok.decoded < 60 * len(tokens), tok.decoded
    for stop in stops:          # a forming stop string is held until it cannot be one
        held = "".join(p.text for p in sent[:-1])
        assert not any(held.endswith(stop[:n]) for n in range(1, len(stop)))
