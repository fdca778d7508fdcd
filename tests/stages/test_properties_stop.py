"""Property tests (hypothesis) for the stop trimmer, driven over many rounds like the pipeline.

Each request has a random token stream, cut into rounds of random sizes (>= 1 token: the verifier's
chunk). Rounds are fed through `specflow_trim` for several requests at once (PAD-padded), committed
tokens are extended and retracted as the pipeline does, and the final tokens and finish reason are
compared with a reference that reads the whole stream at once: so the result must not depend on
where the round boundaries fall, and a stop string split over tokens and over rounds is exercised.
Two fake tokenizers: multi-character pieces (a stop string may start or end inside a token) and
UTF-8 bytes (a character may span tokens, and rounds).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from specflow.stages.stop import IncrementalText, StopConfig, StopTrimmer
from specflow.state import PAD, VerifyOutput

SETTINGS = settings(max_examples=150, deadline=None)


class Pieces:
    """Token i decodes to PIECES[i]; EOS (the last id) decodes to nothing (skip_special_tokens)."""

    PIECES = ["a", "b", "\n", "ab", "ba", "\n\n", "a\n", "b\na", "aab", "\n\nb"]
    EOS = len(PIECES)
    eos_token_id = EOS
    vocab = EOS + 1

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids if i != self.EOS)


class Bytes:
    """UTF-8 bytes as tokens: 'é' takes two, so a character (and a stop string) spans tokens."""

    eos_token_id = None

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def complete(text: str) -> str:
    """Text without a trailing partial character (streams are valid UTF-8 as a whole)."""
    return text[:-1] if text.endswith("\ufffd") else text


def reference(stream, tok, max_new, stop_ids, eos_ids, strings, include):
    """-> ((fewest, most) tokens kept, finish_reason), reading the whole stream at once.

    A range because a token that decodes to nothing just before a stop string may go either way.
    """
    capped = stream[:max_new]
    toks, reason = capped, None
    for i, t in enumerate(capped):
        if t in stop_ids:
            toks, reason = capped[:i], ("eos" if t in eos_ids else "stop")
            break
    for i in range(len(toks) if strings else 0):
        text = complete(tok.decode(toks[:i + 1]))
        hits = [text.find(s) for s in strings if s in text]
        if not hits:
            continue
        if include:
            return (i + 1, i + 1), "stop"
        before = text[:min(hits)]
        most = max(m for m in range(i + 2) if before.startswith(tok.decode(toks[:m])))
        kept = tok.decode(toks[:most])
        fewest = min(m for m in range(most + 1) if tok.decode(toks[:m]) == kept)
        return (fewest, most), "stop"
    if reason is None and len(capped) == max_new:
        reason = "length"
    return (len(toks), len(toks)), reason


def drive(trimmer, requests, sizes_for):
    """Feed each request's stream in rounds through specflow_trim (the live rows PAD-padded).

    -> {rid: (committed tokens, finish_reason)} as the pipeline would hold them."""
    committed = {rid: [] for rid in requests}
    fed = {rid: 0 for rid in requests}
    rounds = {rid: iter(sizes_for(rid)) for rid in requests}
    reasons = {rid: None for rid in requests}
    live = [rid for rid in requests if requests[rid]]
    while live:
        chunks = []
        for rid in live:
            n = next(rounds[rid], 1)
            chunks.append(requests[rid][fed[rid]:fed[rid] + n])
            fed[rid] += n
        width = max(len(c) for c in chunks)
        out = torch.tensor([c + [PAD] * (width - len(c)) for c in chunks], dtype=torch.long)
        batch = SimpleNamespace(request_ids=list(live))
        res = trimmer.specflow_trim(batch=batch, verified=VerifyOutput(out, torch.zeros(len(live))))
        still = []
        for b, rid in enumerate(live):
            keep, reason = res.committed[b], res.finish_reasons[b]
            retract = res.retract[b] if res.retract else 0
            assert keep == chunks[b][:len(keep)]          # a prefix of this round's chunk
            assert retract == 0 or keep == []             # take-backs only when nothing is kept
            committed[rid].extend(keep)
            event(f"finish: {reason}" + (" (took back earlier tokens)" if retract else ""))
            if retract:
                assert reason == "stop"
                del committed[rid][len(committed[rid]) - retract:]
            if reason is None and fed[rid] < len(requests[rid]):
                still.append(rid)
            else:
                reasons[rid] = reason
        live = still
    return {rid: (committed[rid], reasons[rid]) for rid in requests}


def stop_lists(alphabet: str):
    """0-2 stop strings; often the second is part of the first, so both can complete at once."""
    text = st.text(alphabet=alphabet, min_size=1, max_size=4)

    def second(first):
        part = st.tuples(st.integers(0, len(first) - 1), st.integers(1, len(first))).map(
            lambda ij: first[min(ij):max(ij[0] + 1, ij[1])])
        return st.lists(part | text, max_size=1).flatmap(lambda rest: st.permutations([first, *rest]))

    return st.just([]) | text.flatmap(second)


def stream_text(draw, alphabet: str, stops: list[str]) -> str:
    """Random text, usually with one of the stop strings (or a prefix of one) somewhere inside."""
    filler = st.text(alphabet=alphabet, max_size=10)
    middle = draw(st.sampled_from(stops)) if stops and draw(st.booleans()) else ""
    middle = middle[:draw(st.integers(1, len(middle)))] if middle and draw(st.booleans()) else middle
    return draw(filler) + middle + draw(filler)


def segment(draw, text: str, pieces: list[str]) -> list[int]:
    """Tokens spelling `text`, each chosen among the pieces that match there (a random tokenisation)."""
    ids, i = [], 0
    while i < len(text):
        i_id = draw(st.sampled_from([t for t, p in enumerate(pieces) if p and text.startswith(p, i)]))
        ids.append(i_id)
        i += len(pieces[i_id])
    return ids


def specials(draw, ids: list[int], candidates: list[int]) -> list[int]:
    """Sometimes an EOS or stop token id inserted somewhere."""
    for t in draw(st.lists(st.sampled_from(candidates), max_size=1)):
        at = draw(st.integers(0, len(ids)))
        ids = ids[:at] + [t] + ids[at:]
    return ids


@st.composite
def piece_cases(draw):
    tok = Pieces()
    R = draw(st.integers(1, 3))
    cfg_strings = draw(stop_lists("ab\n"))
    per_request = {rid: draw(st.none() | stop_lists("ab\n")) for rid in range(R)}
    token_ids = draw(st.lists(st.integers(0, tok.vocab - 2), max_size=1))
    streams = {}
    for rid in range(R):
        strings = cfg_strings if per_request[rid] is None else per_request[rid]
        if draw(st.booleans()):    # any tokens at all
            ids = draw(st.lists(st.integers(0, tok.vocab - 1), min_size=1, max_size=24))
        else:                      # text around a stop string, tokenised at random
            ids = segment(draw, stream_text(draw, "ab\n", strings), tok.PIECES)
            ids = specials(draw, ids, [tok.EOS, *token_ids]) or [draw(st.integers(0, tok.vocab - 1))]
        streams[rid] = ids
    return dict(
        tok=tok, streams=streams, cfg_strings=cfg_strings, per_request=per_request,
        token_ids=token_ids, eos=draw(st.booleans()), include=draw(st.booleans()),
        max_new={rid: draw(st.integers(1, 30)) for rid in range(R)},
        sizes={rid: draw(st.lists(st.integers(1, 4), min_size=1, max_size=24)) for rid in range(R)},
    )


@st.composite
def substring_cases(draw):
    """Stop strings cut out of the stream's own text: several complete at once, overlapping."""
    tok = Pieces()
    text = draw(st.text(alphabet="ab\n", min_size=1, max_size=14))
    end = draw(st.integers(1, len(text)))        # strings ending together, starting apart
    together = st.integers(max(0, end - 4), end - 1).map(lambda i: text[i:end])
    anywhere = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 4)).map(
        lambda ij: text[ij[0]:ij[0] + ij[1]])
    strings = draw(st.lists(together | anywhere, min_size=1, max_size=3))
    return dict(
        tok=tok, streams={0: segment(draw, text, tok.PIECES)}, cfg_strings=strings,
        per_request={0: None}, token_ids=[], eos=True, include=draw(st.booleans()),
        max_new={0: 30}, sizes={0: draw(st.lists(st.integers(1, 4), min_size=1, max_size=14))},
    )


@st.composite
def byte_cases(draw):
    tok = Bytes()
    R = draw(st.integers(1, 3))
    cfg_strings = draw(stop_lists("abé\n"))
    per_request = {rid: draw(st.none() | stop_lists("abé\n")) for rid in range(R)}
    streams = {}
    for rid in range(R):
        strings = cfg_strings if per_request[rid] is None else per_request[rid]
        streams[rid] = list((stream_text(draw, "abé\n", strings) or "a").encode())
    return dict(
        tok=tok, streams=streams, cfg_strings=cfg_strings, per_request=per_request,
        token_ids=draw(st.lists(st.sampled_from(list("\né".encode())), max_size=1)),
        eos=True, include=draw(st.booleans()),
        max_new={rid: draw(st.integers(1, 30)) for rid in range(R)},
        sizes={rid: draw(st.lists(st.integers(1, 4), min_size=1, max_size=24)) for rid in range(R)},
    )


def check(c):
    tok = c["tok"]
    ctx = SimpleNamespace(tokenizer=tok, target=SimpleNamespace(
        eos_token_id=tok.eos_token_id, ends=lambda: frozenset({tok.eos_token_id})))
    trimmer = StopTrimmer(StopConfig(strings=c["cfg_strings"], token_ids=c["token_ids"],
                                     eos=c["eos"], include_stop_str=c["include"]), ctx)
    for rid in c["streams"]:
        trimmer.specflow_request_start(slot=rid, request=SimpleNamespace(
            request_id=rid, max_new_tokens=c["max_new"][rid], stop=c["per_request"][rid]))
    got = drive(trimmer, c["streams"], lambda rid: c["sizes"][rid])
    eos_ids = {tok.eos_token_id} if c["eos"] and tok.eos_token_id is not None else set()
    stop_ids = set(c["token_ids"]) | eos_ids
    for rid, stream in c["streams"].items():
        tokens, reason = got[rid]
        strings = c["cfg_strings"] if c["per_request"][rid] is None else c["per_request"][rid]
        (fewest, most), expected_reason = reference(stream, tok, c["max_new"][rid], stop_ids,
                                                    eos_ids, strings, c["include"])
        text = tok.decode(tokens)
        # what any caller relies on, stated directly
        assert tokens == stream[:len(tokens)]                       # a prefix of what was verified
        assert len(tokens) <= c["max_new"][rid]
        assert not set(tokens) & stop_ids                           # EOS / stop ids never kept
        if not c["include"]:
            assert not any(s in complete(text) for s in strings), (text, strings)
        elif reason == "stop" and strings and any(s in complete(text) for s in strings):
            # the stop string is kept, and nothing after the token that completes it
            assert not any(s in complete(tok.decode(tokens[:-1])) for s in strings)
        # and exactly the reference, whatever the round sizes were
        assert (reason, fewest <= len(tokens) <= most) == (expected_reason, True), \
            (tokens, reason, stream[:most], expected_reason, strings)


@SETTINGS
@given(piece_cases())
def test_trimming_over_rounds_equals_trimming_the_whole_stream_pieces(c):
    check(c)


@settings(max_examples=300, deadline=None)
@given(substring_cases())
@example(dict(   # two strings complete on one token; the one listed first starts later
    tok=Pieces(), streams={0: [0, 1]}, cfg_strings=["b", "ab"], per_request={0: None},
    token_ids=[], eos=True, include=False, max_new={0: 30}, sizes={0: [1, 1]}))
def test_trimming_with_stop_strings_taken_from_the_text_itself(c):
    check(c)


@SETTINGS
@given(byte_cases())
def test_trimming_over_rounds_equals_trimming_the_whole_stream_bytes(c):
    check(c)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="abé\n€", max_size=12), st.data())
def test_incremental_text_is_the_decoded_complete_characters(text, data):
    tok = Bytes()
    ids = list(text.encode())
    inc = IncrementalText(tok)
    for i, t in enumerate(ids):
        inc.append(t)
        assert inc.text == complete(tok.decode(ids[:i + 1]))
        finite = [e for e in inc.ends if e != float("inf")]
        assert finite == sorted(finite) and all(e <= len(inc.text) for e in finite)
        # a token's end is set exactly when the character it is part of has completed
        for j in range(i + 1):
            settled = any(complete(tok.decode(ids[:m + 1])) == tok.decode(ids[:m + 1])
                          for m in range(j, i + 1))
            assert (inc.ends[j] != float("inf")) == settled
    assert inc.text == text


# --- end to end: speculative pipelines against the whole plain stream ---------------------------

PROMPTS = ["def f(x):\n", "the cat ", "a = [1, 2"]
PLAIN_LEN = 60


@pytest.fixture(scope="module")
def synthetic_runs():
    """The plain greedy stream of each prompt (no stops), and speculative pipelines to test."""
    from specflow import Pipeline

    base = ["model=synthetic", "draft=synthetic", "max_batch_size=2", "show_progress=false"]
    plain = Pipeline.from_config([*base, "proposer=none"])
    streams = {p: r.token_ids for p, r in zip(PROMPTS, plain.generate(PROMPTS, PLAIN_LEN))}
    spec = {"draft": Pipeline.from_config([*base, "proposer=draft", "proposer.k=5",
                                           "draft.mismatch=0.5"]),
            "ngram": Pipeline.from_config([*base, "proposer=ngram", "proposer.k=4",
                                           "proposer.min_n=1"])}
    return plain.tokenizer, streams, spec


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_speculative_generation_with_stops_equals_trimming_the_plain_stream(synthetic_runs, data):
    """Greedy: rounds of drafts (accepted, rejected, ragged over the batch) and stop strings at
    any place must give exactly the plain stream cut by the reference rule."""
    tok, streams, spec = synthetic_runs
    name = data.draw(st.sampled_from(sorted(spec)), label="proposer")
    texts = {p: tok.decode(s) for p, s in streams.items()}
    cut = st.sampled_from(PROMPTS).flatmap(lambda p: st.tuples(
        st.integers(0, PLAIN_LEN - 1), st.integers(1, 5)).map(
        lambda ij: texts[p][ij[0]:ij[0] + ij[1]]))
    stops = data.draw(st.lists(cut | st.text(alphabet="abc \n", min_size=1, max_size=3),
                               max_size=3), label="stop")
    max_new = data.draw(st.integers(1, PLAIN_LEN), label="max_new_tokens")
    results = spec[name].generate(PROMPTS, max_new, stop=stops)
    for prompt, r in zip(PROMPTS, results):
        (fewest, most), reason = reference(streams[prompt], tok, max_new, set(), set(), stops,
                                           False)
        assert fewest == most                      # one character per token
        assert (r.token_ids, r.finish_reason) == (streams[prompt][:most], reason), (prompt, stops)
        assert r.text == tok.decode(r.token_ids)
        assert not any(s in r.text for s in stops)
        assert len(r.token_ids) <= max_new
        event(f"{name}: {r.finish_reason}, alpha {'< 1' if r.stats.get('alpha', 1) < 1 else '1'}")
