"""Where prompts come from and whether they go in as chat turns (specflow/app/prompts.py): an
explicit prompt follows `chat` (auto by default: the model's chat template when it has one), a
workload its own `workload.chat`."""
from __future__ import annotations

import json
import shutil

from specflow.app.folder_run import run_into
from specflow.experiments.workloads import chat_mode
from specflow.config import compose
from specflow.backends.hf.backend import DEMO_DIR

TEMPLATE = "{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}<bot>"


def test_an_explicit_prompt_follows_chat_and_a_workload_its_own_setting():
    assert chat_mode(compose(["prompt=hi"])) == "auto"
    assert chat_mode(compose(["prompt=hi", "chat=off"])) == "off"
    assert chat_mode(compose(["prompt=-", "chat=on"])) == "on"
    assert chat_mode(compose(["workload=code"])) == "auto"
    assert chat_mode(compose(["workload=code", "workload.chat=off", "chat=on"])) == "off"
    assert chat_mode(compose([])) == "off"                  # the demo prompts: code, no turns


def test_a_prompt_to_a_model_with_a_chat_template_goes_in_as_a_user_turn(tmp_path):
    model = tmp_path / "chatty"
    shutil.copytree(DEMO_DIR / "draft", model)               # a small model, given a template
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    base = ["model=hf", f"model.path={model}", "proposer=ngram", "max_new_tokens=4",
            "show_progress=false"]
    for extra, wrapped in (([], True), (["chat=off"], False)):
        out = tmp_path / f"run-{wrapped}"
        run = run_into(compose([*base, "prompt=def f(x):", *extra]), out, owner="test",
                       setting="hydra.run.dir", rerun="rerun", progress=False,
                       replace_finished=True)
        prompt = json.loads((out / "requests.jsonl").read_text().splitlines()[0])["prompt"]
        assert run.chat is wrapped
        assert json.loads((out / "metrics.json").read_text())["chat_template"] is wrapped
        assert prompt == ("<user>def f(x):</user><bot>" if wrapped else "def f(x):")
