"""The stop trimmer: nothing after a stop, in any round, inside any chunk (pitfalls 5-9 in docs/design.md)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specflow.stages.stop import IncrementalText, StopConfig, StopTrimmer
from specflow.state import DecodeBatch, PAD, VerifyOutput

EOS = 9


class PieceTokenizer:
    """Token i decodes to PIECES[i]; multi-character pieces let stop strings split anywhere."""

    PIECES = ["ab", "c", "\n", "\n\nx", "d", "STO", "P", "e", "fg", "<eos>"]
    eos_token_id = EOS

    def decode(self, ids):
        return "".join(self.PIECES[i] for i in ids if i != EOS)


class ByteTokenizer:
    """UTF-8 bytes as tokens: one character may take several tokens (like byte-level BPE)."""

    eos_token_id = None

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def trimmer(tokenizer=None, **cfg):
    tok = tokenizer or PieceTokenizer()
    ctx = SimpleNamespace(tokenizer=tok, target=SimpleNamespace(
        eos_token_id=tok.eos_token_id, ends=lambda: frozenset({tok.eos_token_id})))
    return StopTrimmer(StopConfig(**cfg), ctx)


def start(t, max_new_tokens=50, stop=None, rid=0):
    req = SimpleNamespace(request_id=rid, max_new_tokens=max_new_tokens, stop=stop)
    t.specflow_request_start(slot=0, request=req)
    return t.rows[rid]


def test_stop_string_inside_a_multi_token_chunk_cuts_everything_after_it():
    t = trimmer(strings=["STOP"])
    row = start(t)
    keep, reason, retract = t.trim_row(row, [0, 1, 5, 6, 7, 8])   # "ab c STO P e fg"
    assert (keep, reason, retract) == ([0, 1], "stop", 0)
    assert t.tokenizer.decode(keep) == "abc"


def test_stop_string_split_across_rounds_takes_back_the_earlier_tokens():
    t = trimmer(strings=["STOP"])
    row = start(t)
    assert t.trim_row(row, [0, 5]) == ([0, 5], None, 0)                # "abSTO": not yet
    assert t.trim_row(row, [6, 7]) == ([], "stop", 1)                  # "P" completes it: "STO"
                                                                        # is taken back


def test_stop_string_ending_inside_a_token_keeps_only_tokens_before_it():
    t = trimmer(strings=["\n\n"])
    row = start(t)
    keep, reason, _ = t.trim_row(row, [0, 3, 4])                       # "ab" + "\n\nx" + "d"
    assert (keep, reason) == ([0], "stop")


def test_include_stop_str_keeps_the_string_and_its_tokens():
    t = trimmer(strings=["STOP"], include_stop_str=True)
    row = start(t)
    assert t.trim_row(row, [0, 5, 6, 7]) == ([0, 5, 6], "stop", 0)


def test_eos_mid_chunk_is_excluded_and_ends_the_row():
    t = trimmer()
    row = start(t)
    keep, reason, _ = t.trim_row(row, [0, 1, EOS, 4])
    assert (keep, reason) == ([0, 1], "eos")


def test_stop_token_ids_end_with_stop():
    t = trimmer(token_ids=[4])
    row = start(t)
    assert t.trim_row(row, [0, 4, 1])[:2] == ([0], "stop")


def test_stop_inside_the_length_cap_wins_over_the_cap():
    # cap leaves 3 tokens; the stop string completes on the 3rd: finish_reason is "stop"
    t = trimmer(strings=["STOP"])
    row = start(t, max_new_tokens=3)
    assert t.trim_row(row, [0, 5, 6, 7, 8]) == ([0], "stop", 0)


def test_stop_after_the_length_cap_is_not_seen_and_nothing_leaks():
    t = trimmer(strings=["STOP"])
    row = start(t, max_new_tokens=2)
    assert t.trim_row(row, [0, 1, 5, 6]) == ([0, 1], "length", 0)


def test_every_eos_id_the_model_declares_ends_the_row():
    tok = PieceTokenizer()
    ctx = SimpleNamespace(tokenizer=tok, target=SimpleNamespace(eos_token_id=EOS,
                                                                ends=lambda: frozenset({EOS, 7})))
    t = StopTrimmer(StopConfig(), ctx)
    row = start(t)
    assert t.trim_row(row, [0, 7, 1])[:2] == ([0], "eos")


def test_eos_on_the_last_allowed_token_is_eos_not_length():
    t = trimmer()
    row = start(t, max_new_tokens=3)
    assert t.trim_row(row, [0, 1, EOS, 4])[:2] == ([0, 1], "eos")


def test_per_request_stop_overrides_the_config():
    t = trimmer(strings=["STOP"])
    row = start(t, stop=["fg"])
    assert t.trim_row(row, [0, 5, 6, 8]) == ([0, 5, 6], "stop", 0)


def test_characters_split_over_tokens_are_decoded_once_complete():
    inc = IncrementalText(ByteTokenizer())
    for b in "é!".encode():                                   # é is two bytes
        inc.append(b)
    assert inc.text == "é!" and inc.ends == [1, 1, 2]


def test_stop_string_made_of_multibyte_characters_split_over_tokens():
    t = trimmer(ByteTokenizer(), strings=["é"])
    row = start(t)
    data = list("abé c".encode())
    keep, reason, _ = t.trim_row(row, data)
    assert (bytes(keep), reason) == (b"ab", "stop")


def test_trim_hook_handles_padded_rows():
    t = trimmer(strings=["STOP"])
    for rid in (0, 1):
        start(t, rid=rid)
    batch = DecodeBatch.make_dummy(batch_size=2)
    out = torch.tensor([[0, 5, 6, PAD], [1, PAD, PAD, PAD]])
    result = t.specflow_trim(batch=batch, verified=VerifyOutput(out, torch.tensor([2, 0])))
    assert result.committed == [[0], [1]]
    assert result.finish_reasons == ["stop", None]


def test_empty_stop_string_is_refused():
    from specflow import ConfigError
    with pytest.raises(ConfigError, match="empty string"):
        StopConfig(strings=[""])
