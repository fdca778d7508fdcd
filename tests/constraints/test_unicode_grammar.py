"""Grammar constraints over non-ASCII text: the vocabulary is built from each token's bytes, so a
byte-level BPE token holding part of a multi-byte character is a step through that character
(not an unusable U+FFFD) and choices, schemas and regexes with accents, arrows or CJK are writable.
"""
from __future__ import annotations

import json
import re

import pytest

from specflow import ConfigError, Pipeline
from specflow.constraints import index
from specflow.experiments.workloads import read_prompt_file
from specflow.backends.hf.backend import DEMO_DIR

PROMPTS = ["# a drink\n", "def f():\n", *read_prompt_file(str(DEMO_DIR / "prompts.jsonl"))[:2]]
CHOICES = ["constraint=choice", "constraint.choices=['café','thé']"]
PATTERN = "(é|→|日本){1,3}"


def pipe(*overrides):
    return Pipeline.from_config([*overrides, "max_batch_size=4"])


@pytest.fixture(scope="module")
def demo_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_DIR / "target")


def test_demo_vocabulary_spells_each_token_by_its_bytes(demo_tok):
    text = "日本 café"
    ids = demo_tok.encode(text, add_special_tokens=False)
    vocab = index.tokenizer_vocabulary(demo_tok, demo_tok.eos_token_id)
    read = index.token_bytes_reader(demo_tok)
    spelled = [read(t) for t in demo_tok.convert_ids_to_tokens(ids)]
    assert b"".join(spelled) == text.encode("utf-8")
    assert any(len(b) == 1 and b[0] >= 0x80 for b in spelled)    # a partial character among them
    for i, b in zip(ids, spelled):
        assert i in vocab.get(b)
    assert vocab.get("\ufffd") is None        # no partial character stands for U+FFFD any more
    assert index.token_spelling(demo_tok) == ("byte_level",)


def test_choices_with_accents_greedy():
    for r in pipe("proposer=ngram", *CHOICES).generate(PROMPTS, max_new_tokens=8):
        assert r.finish_reason == "eos" and r.text in ("café", "thé"), r.text


def test_choices_with_accents_sampled():
    p = pipe("proposer=ngram", *CHOICES, "logits=[temperature]", "logits.temperature.value=1.5")
    for seed in range(4):
        for r in p.generate(PROMPTS, max_new_tokens=8, seed=seed):
            assert r.finish_reason == "eos" and r.text in ("café", "thé"), (seed, r.text)


def test_json_schema_enum_with_accents():
    schema = json.dumps({"enum": ["café", "naïve"]}, ensure_ascii=False)
    assert "é" in schema and "ï" in schema
    p = pipe("proposer=ngram", "constraint=json_schema", f"constraint.schema='{schema}'")
    for r in p.generate(PROMPTS, max_new_tokens=12):
        assert r.finish_reason == "eos" and json.loads(r.text) in ("café", "naïve"), r.text


@pytest.mark.parametrize("pattern", [PATTERN, "(é|→|日本){3,8}"])
def test_regex_with_multibyte_characters_is_exact_under_speculation(pattern):
    constraint = ["constraint=regex", f"constraint.pattern='{pattern}'"]
    outs, accepted = {}, {}
    for proposer in ("none", "ngram", "draft"):
        p = pipe(f"proposer={proposer}", *constraint)
        outs[proposer] = p.generate(PROMPTS, max_new_tokens=16)
        accepted[proposer] = p.last_stats.get("num_accepted_tokens", 0)
    for r in outs["none"]:
        assert r.finish_reason == "eos" and re.fullmatch(pattern, r.text), r.text
    expected = [r.token_ids for r in outs["none"]]
    assert [r.token_ids for r in outs["ngram"]] == expected
    assert [r.token_ids for r in outs["draft"]] == expected
    assert accepted["draft"] > 0       # drafts through partial characters are accepted


def test_unspellable_pattern_is_still_one_line_error(demo_tok):
    class PlainTok:       # a word-level tokenizer: no byte tokens, so "é" cannot be written
        all_special_ids = [0]

        def __init__(self):
            self.vocab = {"<eos>": 0, "caf": 1, "e": 2, "th": 3}

        def get_vocab(self):
            return self.vocab

        def __len__(self):
            return len(self.vocab)

        def convert_tokens_to_string(self, tokens):
            return "".join(tokens)

    assert index.token_spelling(PlainTok()) == ("plain",)
    assert index.compile_index("(cafe|the)", PlainTok(), 0, "constraint.choices")
    with pytest.raises(ConfigError) as err:
        index.compile_index("(café|thé)", PlainTok(), 0, "constraint.choices")
    assert "tokens do not spell" in str(err.value) and "\n" not in str(err.value)
    # the demo tokenizer has a token for every byte, so it can spell any text: nothing to refuse
    read = index.token_bytes_reader(demo_tok)
    single = {read(t) for t in demo_tok.get_vocab()}
    assert all(bytes([b]) in single for b in range(256))


def test_sentencepiece_byte_fallback_vocabulary():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in ["▁", "c", "a", "f", "▁caf", "é", "t", "h", "▁thé"]:
        vocab.setdefault(t, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    assert index.token_spelling(tok) == ("sentencepiece", True, (("▁", " "),))
    read = index.token_bytes_reader(tok)
    ids = tok.encode("日本 café", add_special_tokens=False)
    assert b"".join(read(t) for t in tok.convert_ids_to_tokens(ids)) == " 日本 café".encode()
    vocab_obj = index.tokenizer_vocabulary(tok, tok.eos_token_id)
    assert sorted(vocab_obj.get(b" ")) == [vocab["<0x20>"], vocab["▁"]]
    assert vocab_obj.get(b"\xe6") == [vocab["<0xE6>"]]
    idx = index.compile_index("( café| thé| 日本)", tok, tok.eos_token_id, "constraint.choices")
    assert vocab["▁caf"] in idx.get_allowed_tokens(idx.get_initial_state())


def test_vocab_key_depends_on_how_tokens_are_spelled():
    class Tok:
        all_special_ids = [0]

        def __init__(self, byte_level):
            self.vocab = {"<eos>": 0, "Ġa": 1, "Ã": 2}
            if byte_level:
                self.byte_decoder = {"Ġ": 32}

        def get_vocab(self):
            return self.vocab

        def __len__(self):
            return len(self.vocab)

    assert index.vocab_key(Tok(True), 0) != index.vocab_key(Tok(False), 0)
    assert index.vocab_key(Tok(True), 0) == index.vocab_key(Tok(True), 0)
