"""Workloads: shipped prompt sets, category filters, JSONL files, chat templates."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specflow import ConfigError, InputError
from specflow.config import compose, option
from specflow.experiments.workloads import apply_chat_template, read_prompt_file
from specflow.plugins import get_registry


def prompts_of(*overrides):
    node = option(compose(list(overrides)), "workload")
    return get_registry().get("workload", node.name).factory(node, None).prompts()


def test_spec_bench_and_mt_bench_ship_with_the_package():
    assert len(prompts_of("workload=spec_bench")) == 130
    qa = prompts_of("workload=spec_bench", "workload.where={category: qa}")
    assert len(qa) == 10
    assert len(prompts_of("workload=mt_bench")) == 40
    assert len(prompts_of("workload=code")) == 20


def test_where_filter_that_matches_nothing_is_a_clear_error():
    with pytest.raises(InputError, match="no prompts matching"):
        prompts_of("workload=spec_bench", "workload.where={category: poetry}")


def test_jsonl_list_fields_take_the_first_turn(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": ["first", "second"]}\n{"turns": ["again"]}\n')
    assert read_prompt_file(str(path), "turns") == ["first", "again"]


def test_chat_template_when_the_tokenizer_has_one():
    class Tok:
        chat_template = "{{ messages[0].content }}"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return f"<user>{messages[0]['content']}</user><assistant>"

    with_template = SimpleNamespace(tok=Tok())
    assert apply_chat_template(["hi"], with_template, "auto") == ["<user>hi</user><assistant>"]
    assert apply_chat_template(["hi"], with_template, "off") == ["hi"]
    bare = SimpleNamespace(tok=SimpleNamespace(chat_template=None))
    assert apply_chat_template(["hi"], bare, "auto") == ["hi"]
    with pytest.raises(ConfigError, match="no chat template"):
        apply_chat_template(["hi"], bare, "on")
