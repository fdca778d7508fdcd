"""Escapes in the free-text lists of a config (stop strings, choices, bad words) mean what a user
means: `'stop.strings=["\\n\\n"]'` is a blank line (Hydra alone keeps the backslashes), and a
backslash that starts no escape is one line at compose time. Python strings are never decoded."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from specflow import Pipeline
from specflow.config import compose, decode_escapes
from specflow.errors import ConfigError

SYN = ["model=synthetic", "draft=synthetic"]


@pytest.mark.parametrize("override,expected", [
    ('stop.strings=["\\n\\n"]', ["\n\n"]),                  # docs/config.md's example
    ("stop.strings=['\\n\\n']", ["\n\n"]),
    ("stop.strings=[\\n, a\\tb]", ["\n", "a\tb"]),            # bare elements too
    ('stop.strings=["C:\\\\path", "\\"q\\"", "it\\\'s"]', ["C:\\path", '"q"', "it's"]),
    ('stop.strings=["\\u00e9\\x41\\U0001F600", "\\ud83d\\ude00"]', ["éA😀", "😀"]),
    ("stop.strings=[\\${x}, ${y}]", ["${x}", "${y}"]),        # `${` stays text either way
    ("stop.strings=['\r\n']", ["\r\n"]),                      # real characters stay as they are
])
def test_stop_string_escapes_are_decoded(override, expected):
    cfg = compose([*SYN, override])
    assert list(cfg.stop.strings) == expected
    assert OmegaConf.to_container(cfg, resolve=True)["stop"]["strings"] == expected


def test_choices_and_bad_words_take_the_same_escapes_prompts_and_patterns_none():
    cfg = compose(["proposer=ngram", "constraint=choice", 'constraint.choices=["a\\nb", c]'])
    assert list(cfg.constraint.choices) == ["a\nb", "c"]
    cfg = compose([*SYN, "logits=[bad_words]", "logits.bad_words.words=['\\tx']",
                   "prompt=print('a\\nb')"])
    assert list(cfg.logits.bad_words.words) == ["\tx"]
    assert cfg.prompt == "print('a\\nb')"                # code: its backslashes are its own
    cfg = compose(["proposer=ngram", "constraint=regex", "constraint.pattern=\\d+\\n"])
    assert cfg.constraint.pattern == "\\d+\\n"          # the regex engine reads its own escapes


@pytest.mark.parametrize("override,needle", [
    ('stop.strings=["C:\\path"]', "stop.strings[0] has \\p, which is not an escape; write \\\\"),
    ("stop.strings=[ok, 'a\\qb']", "stop.strings[1] has \\q, which is not an escape"),
    ("stop.strings=[ab\\]", "stop.strings[0] has a lone \\ at the end"),
    ('stop.strings=["\\x4"]', "has the escape \\x4, which needs 2 hex digits"),
    ('stop.strings=["\\uD83D"]', "has the lone surrogate \\ud83d"),
    ('stop.strings=["\\U00110000"]', "needs 8 hex digits of a Unicode code point"),
    ("logits.bad_words.words=['\\w+']", "logits.bad_words.words[0] has \\w, which is not an escape"),
])
def test_a_backslash_that_starts_no_escape_is_one_line(override, needle):
    overrides = [*SYN, override] if override.startswith("stop") else \
        [*SYN, "logits=[bad_words]", override]
    with pytest.raises(ConfigError) as info:
        compose(overrides)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_escapes_are_decoded_once():
    """compose() decodes; building the pipeline validates the config again and must not decode a
    second time (a literal backslash would turn into an escape or an error)."""
    pipe = Pipeline.from_config([*SYN, 'stop.strings=["a\\\\nb", "\\n"]'])
    assert list(pipe.cfg.stop.strings) == ["a\\nb", "\n"]
    trimmer = pipe.pm.get_plugin("stop.default")
    assert list(trimmer.cfg.strings) == ["a\\nb", "\n"]
    engine = pipe.engine()
    assert engine.config_stop == ["a\\nb", "\n"]
    engine.close()
    # generate(stop=[...]) takes Python strings as they are: "\\n" is a backslash and an n
    assert pipe.make_requests(["abc"], 4, ["\\n"], None, None)[0].stop == ["\\n"]


def test_a_yaml_newline_stays_one():
    """A config file's double-quoted "\\n" is a newline already: nothing changes it."""
    cfg = OmegaConf.create({"stop": {"name": "default", "strings": ["\n", "x"]}})
    assert list(decode_escapes(cfg).stop.strings) == ["\n", "x"]
