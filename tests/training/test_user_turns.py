"""train_head.chat_turns: user turns the target writes itself after its pre-query template."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specflow import ConfigError
from specflow.experiments.workloads import apply_chat_template
from specflow.training import user_turns

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Tok:
    """A tokenizer with only what the chat template needs (transformers' jinja renders it)."""

    def __init__(self, template: str | None = TEMPLATE):
        from transformers import PreTrainedTokenizerFast
        from tokenizers import Tokenizer, models

        self.tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
            {"<unk>": 0}, unk_token="<unk>")))
        self.tok.chat_template = template


class FakePipe:
    """generate() answers from a script of (text, finish_reason) per call; records its calls."""

    def __init__(self, script):
        self.tokenizer = Tok()
        self.script = list(script)
        self.calls = []

    def generate(self, prompts, max_new_tokens, seed, sampling, indices, on_result):
        self.calls.append((list(prompts), seed, sampling, list(indices)))
        out = self.script.pop(0)
        assert len(out) == len(prompts)
        results = [SimpleNamespace(index=i, text=t, finish_reason=f)
                   for i, (t, f) in zip(indices, out)]
        for result in reversed(results):        # finishing out of order keeps index order
            on_result(result)
        return results


def test_the_pre_query_template_is_the_chat_template_up_to_a_user_turn_s_content():
    assert user_turns.pre_query_template(Tok()) == "<|im_start|>user\n"
    # each sampled turn is then wrapped as the chat workloads wrap a prompt
    prompt, = apply_chat_template(["What is 2 + 2?"], Tok(), "on")
    assert prompt == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"


def test_a_target_without_a_chat_template_is_one_line_naming_the_fix():
    with pytest.raises(ConfigError) as info:
        user_turns.pre_query_template(Tok(template=None))
    assert "\n" not in str(info.value) and "train_head.chat_turns=0" in str(info.value)


def test_turns_that_run_out_repeat_or_are_empty_are_drawn_again_from_fresh_seeds():
    pipe = FakePipe([
        [("How do I sort a list?", "eos"), ("  ", "eos"), ("a turn that never ends", "length"),
         ("How do I sort a list?", "eos")],
        [("Plan a trip.", "eos"), ("Why is the sky blue?", "stop"), ("x", "length")],
        [("Name three rivers.", "eos")],
    ])
    seen = []
    got = user_turns.sample_user_turns(pipe, 4, seed=7, advance=seen.append)
    assert got == ["How do I sort a list?", "Plan a trip.", "Why is the sky blue?",
                   "Name three rivers."]
    assert len(seen) == 4            # advanced as each new one ended
    # every draw is a new request index (its own seed offset), never a repeat of one drawn
    assert [c[3] for c in pipe.calls] == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert all(c[1] == 7 and c[2] == user_turns.SAMPLING for c in pipe.calls)
    assert all(p == ["<|im_start|>user\n"] * len(p) for p, *_ in pipe.calls)


def test_drawing_stops_at_four_times_the_turns_asked_for():
    pipe = FakePipe([[("never", "length")] * n for n in (2, 2, 2, 2)])
    assert user_turns.sample_user_turns(pipe, 2, seed=0, advance=lambda n: None) == []
    assert len(pipe.calls) == 4


def test_interleave_spreads_both_lists_so_the_held_out_tail_has_both():
    mixed = user_turns.interleave(list("abcdef"), [1, 2, 3])
    assert sorted(map(str, mixed)) == sorted(map(str, list("abcdef") + [1, 2, 3]))
    assert mixed[-3:] != ["d", "e", "f"] and set(map(type, mixed[-3:])) == {str, int}
    assert user_turns.interleave([], [1]) == [1] and user_turns.interleave([1], []) == [1]


def test_train_head_with_chat_turns_on_a_target_without_a_chat_template_is_one_line(tmp_path):
    """The demo target's tokenizer has no chat template: the CLI says so before any decoding."""
    import os
    import subprocess
    import sys

    specflow = os.path.join(os.path.dirname(sys.executable), "specflow")
    out = subprocess.run([specflow, "train-head", "model=demo", "threads=1",
                          "train_head.chat_turns=4", f"train_head.output={tmp_path}/head",
                          f"hydra.run.dir={tmp_path}/run", "--quiet"], capture_output=True,
                         timeout=300, env={**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"})
    err = out.stderr.decode().strip()
    assert out.returncode == 2, err
    assert err.startswith("specflow: error:") and len(err.splitlines()) == 1, err
    assert "needs a target with a chat template" in err
    assert not (tmp_path / "head" / "train_data.pt").exists()
