"""The bad-input table of docs/bad-input.md, row by row, through the CLI and through the Python API.

Every row: one line that names the value and the fix, exit code 2 (SpecflowError.exit_code on the
API), and no metrics.json (the file that marks a finished run). ROWS is checked against
docs/bad-input.md so the table users read is the table tested here.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from fake_plugins import install_fake_plugin

from specflow import Pipeline, SpecflowError
from specflow.config import compose

ROOT = pathlib.Path(__file__).resolve().parents[1]
SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
SYN = ["model=synthetic", "draft=synthetic"]


def _mismatched_draft(tmp: pathlib.Path) -> str:
    """The demo draft with another tokenizer (a 300-token BPE): a draft from another family."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from specflow.backends.hf.backend import DEMO_DIR

    dst = tmp / "other-draft"
    if not dst.exists():
        shutil.copytree(DEMO_DIR / "draft", dst)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator([textwrap.__doc__ or "abc"] * 3, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(dst)
    return str(dst)


RAISING_PLUGIN = '''
from dataclasses import dataclass
from specflow import hookimpl

@dataclass
class BoomConfig:
    name: str = "boom"
    k: int = 2

class Boom:
    def __init__(self, cfg, ctx):
        pass
    @hookimpl
    def specflow_propose(self, batch, k):
        raise ZeroDivisionError("table is empty")

@hookimpl
def specflow_register(registry):
    registry.add("proposer", "boom", Boom, BoomConfig)

@hookimpl
def specflow_config_searchpath():
    return "pkg://{module}.conf"
'''


def _install_raising_plugin(tmp: pathlib.Path) -> pathlib.Path:
    root = tmp / "site"
    if not root.exists():
        install_fake_plugin(root, "fake_specflow_boom", RAISING_PLUGIN, version="1.2.0",
                            option=("proposer", "boom"))
    return root


def _files(tmp: pathlib.Path) -> None:
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp / "null.jsonl").write_text('{"prompt": "def f():"}\n{"prompt": null}\n')
    (tmp / "empty-model").mkdir(exist_ok=True)
    _repeating_head(tmp / "head-repeat")
    (tmp / "zip.gguf").write_bytes(b"PK\x03\x04 an archive, not a model")
    _gguf(tmp / "rwkv.gguf", "rwkv6")
    whole = _gguf(tmp / "whole.gguf", "llama").read_bytes()
    (tmp / "cut.gguf").write_bytes(whole[:len(whole) - 100])
    (tmp / "two-ggufs").mkdir(exist_ok=True)
    for name in ("a.Q4_0.gguf", "b.Q8_0.gguf"):
        (tmp / "two-ggufs" / name).write_bytes(whole)


def _gguf(dst: pathlib.Path, arch: str) -> pathlib.Path:
    """A small GGUF file of `arch` (a header and one 64 x 64 tensor)."""
    import gguf

    w = gguf.GGUFWriter(str(dst), arch)
    w.add_tensor("token_embd.weight", torch.zeros(64, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _repeating_head(dst: pathlib.Path) -> None:
    """The shipped demo head's config.json, reading layer 2 twice (compose time reads no more)."""
    import json

    from specflow.backends.heads.eagle import DEMO_HEAD

    config = json.loads((DEMO_HEAD / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 2]
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))


# (input, CLI arguments, what the API call is, message on the CLI, message on the API)
# {tmp} is the test's folder, {draft} a draft with another tokenizer
ROWS = [
    ("unknown config option", [*SYN, "proposer.kk=3"], "compose",
     "unknown config key 'proposer.kk'", None),
    ("wrong type", [*SYN, "proposer.k=two"], "compose", "could not be converted to Integer", None),
    ("k < 0", [*SYN, "proposer.k=-1"], "compose", "proposer.k=-1 must be >= 0", None),
    ("temperature < 0", [*SYN, "logits=[temperature]", "logits.temperature.value=-1"], "compose",
     "logits.temperature.value=-1.0 must be >= 0", None),
    ("top_p outside (0, 1]", [*SYN, "logits=[top_p]", "logits.top_p.p=1.5"], "compose",
     "logits.top_p.p=1.5 must be in (0, 1]", None),
    ("empty prompt", [*SYN, "prompt="], "generate:['']", "prompt 0 is empty", None),
    ("empty prompt list", [*SYN, "workload=file", "workload.path={tmp}/empty.txt"],
     "generate:[]", "has no prompts", "no prompts given"),
    ("prompt longer than the context", [*SYN, "model.max_length=8", "prompt=abcdefghij"],
     "generate:['abcdefghij']", "has 10 tokens but the model's context is 8", None),
    ("non-UTF-8 prompt file", [*SYN, "workload=file", "workload.path={tmp}/latin1.txt"],
     "prompt_file:{tmp}/latin1.txt", "is not UTF-8", None),
    ("invalid JSON Schema", ["proposer=ngram", "constraint=json_schema",
                             'constraint.schema={"type": "objekt"}'], "build",
     "not a valid JSON Schema", None),
    ("empty stop string", [*SYN, "stop.strings=['']"], "generate_stop:['']",
     "empty string", "a stop string is empty"),
    ("tokenizer mismatch", ["draft=hf", "draft.path={draft}"], "build",
     "does not share the tokenizer", None),
    ("missing model path", ["model=hf", "model.path={tmp}/no-model", "proposer=ngram"], "build",
     "is not a directory; set model.path", None),
    ("CUDA without a GPU", [*SYN, "device=cuda"], "build", "has no CUDA GPU", None),
    ("model folder that cannot load", ["model=hf", "model.path={tmp}/empty-model",
                                       "proposer=ngram"], "build",
     "is an empty folder; point model.path at a folder that", None),
    ("hub id not in the local cache", ["model=hf", "model.path=nosuchorg/nosuchmodel",
                                       "proposer=ngram"], "build",
     "not in the local Hugging Face cache", None),
    ("prompt line of the wrong type", [*SYN, "workload=file", "workload.path={tmp}/null.jsonl"],
     "prompt_file:{tmp}/null.jsonl", "null.jsonl:2: field 'prompt' is a JSON null, not a string",
     None),
    ("class_path that is not a LogitsProcessor", [*SYN, "logits=[hf]",
                                                  "logits.hf.class_path=os:system"], "build",
     "is the function system, not a subclass of transformers.LogitsProcessor", None),
    ("non-finite number", [*SYN, "logits=[temperature]", "logits.temperature.value=inf"],
     "compose", "logits.temperature.value=inf is not a finite number; give a finite value", None),
    ("NaN or +inf logit bias", [*SYN, "logits=[logit_bias]", "logits.logit_bias.bias={0: nan}"],
     "compose", "logits.logit_bias.bias.0=nan is not a finite number; give a finite value or -inf",
     None),
    ("root value of the wrong type", [*SYN, "seed=abc"],
     "generate_kw:{'max_new_tokens': 2.5}", "seed='abc' is not a whole number",
     "max_new_tokens=2.5 is not a whole number"),
    ("root value out of range", [*SYN, "max_batch_size=100000"],
     "generate_kw:{'max_batch_size': -1}", "max_batch_size=100000 is out of range [1, 4096]",
     "max_batch_size=-1 must be >= 1"),
    ("a deleted group", [*SYN, "~stop"], "compose",
     "~stop deletes the stop group, which every run needs", None),
    ("unknown root key", [*SYN, "+max_new_token=5"], "compose",
     "unknown config key 'max_new_token' (from +max_new_token=5); the root config has:", None),
    ("unknown device", [*SYN, "device=tpu"], "compose", "device='tpu' is not a device", None),
    ("settings that leave no token", ["proposer=none", "constraint=choice",
                                      "constraint.choices=[yes,no]", "logits=[min_new_tokens]",
                                      "logits.min_new_tokens.min_tokens=6", "prompt=def f(x):"],
     "generate:['def f(x):']", "constraint.choice allows only 1 token(s) here and "
     "logits.min_new_tokens forbids all of them", None),
    ("a draft head on the synthetic model", [*SYN, "proposer=eagle"], "build",
     "proposer=eagle reads the hidden states of a transformers target", None),
    ("a folder that is not a draft head", ["proposer=eagle", "proposer.path={tmp}/empty-model"],
     "build", "has no config.json, so it is not a draft head", None),
    ("a draft head that repeats a layer", ["proposer=eagle", "proposer.path={tmp}/head-repeat"],
     "compose", "eagle_aux_hidden_state_layer_ids repeats layer 2 in [1, 2, 2]", None),
    ("an unknown draft-head dtype", ["proposer=eagle", "proposer.dtype=fp8"], "compose",
     "proposer.dtype='fp8'; use auto (the head as saved, or the target's 16-bit dtype), float32, bfloat16, "
     "float16, int8 or int4", None),
    ("a draft head's confidence outside 0-1", ["proposer=eagle", "proposer.min_confidence=1.5"],
     "compose", "proposer.min_confidence=1.5 must lie between 0 and 1 (e.g. 0.4), or be null for k "
     "drafts a row", None),
    ("tree width < 1", [*SYN, "proposer=ngram", "proposer.topk=0"], "compose",
     "proposer.topk=0 must be >= 1 (1 = a chain, more = a tree)", None),
    ("node budget under the tree depth", [*SYN, "proposer=draft", "proposer.topk=4",
                                          "proposer.num_draft_tokens=2"], "compose",
     "proposer.num_draft_tokens=2 is smaller than the depth proposer.k=4", None),
    ("node budget past the context", [*SYN, "model.max_length=64", "proposer=ngram",
                                      "proposer.topk=4", "proposer.num_draft_tokens=100"], "build",
     "proposer.num_draft_tokens=100 leaves no room in the model's 64-token context", None),
    ("a tree from a proposer that cannot build one", [*SYN, "proposer=none", "proposer.topk=4"],
     "compose", "unknown config key 'proposer.topk': proposer=none drafts chains only (its "
     "keys: name, k); token trees come from proposer=draft, eagle or ngram", None),
    ("a plugin that raises", [*SYN, "proposer=boom"], "plugin",
     "plugin proposer.boom (fake-specflow-boom 1.2.0) raised ZeroDivisionError: table is empty "
     "in hook specflow_propose", None),
    ("a backslash that starts no escape", [*SYN, 'stop.strings=["C:\\path"]'], "compose",
     "stop.strings[0] has \\p, which is not an escape; write \\\\ for a backslash", None),
    ("infinity written as text", [*SYN, "logits=[temperature]",
                                  "logits.temperature.value=Infinity"], "compose",
     "logits.temperature.value=inf is not a finite number; give a finite value", None),
    ("sampling value that is not a whole number", [*SYN, "logits=[top_k]", "logits.top_k.k=5.7"],
     "generate_sampling:{'top_k': 5.7}",
     "logits.top_k.k: Value '5.7' of type 'float' could not be converted to Integer",
     "prompt 0: sampling top_k=5.7 must be a whole number"),
    ("negative token id", [*SYN, "stop.token_ids=[-1]"], "compose",
     "stop.token_ids has -1, which is not a token id", None),
    ("token id outside the vocabulary", [*SYN, "stop.token_ids=[64]"], "build",
     "stop.token_ids has token id 64, outside the target's vocabulary of 64 tokens (ids 0 to 63)",
     None),
    ("tree width past the context", [*SYN, "model.max_length=64", "proposer=ngram",
                                     "proposer.topk=64", "proposer.num_draft_tokens=8"], "build",
     "proposer.topk=64 leaves no room in the model's 64-token context", None),
    ("a file that is not GGUF", ["model=hf", "model.path={tmp}/zip.gguf", "proposer=ngram"],
     "build", "zip.gguf' is not a GGUF file (it starts with b'PK\\x03\\x04', "
     "not b'GGUF')", None),
    ("a truncated GGUF", ["model=hf", "model.path={tmp}/cut.gguf", "proposer=ngram"], "build",
     "cut.gguf' is truncated or damaged", None),
    ("a GGUF of an architecture transformers cannot read",
     ["model=hf", "model.path={tmp}/rwkv.gguf", "proposer=ngram"], "build",
     "holds a 'rwkv6' model, an architecture transformers cannot read from GGUF", None),
    ("a model package that is not installed",
     ["model=hf", "model.path=pkg:no_such_models/model.gguf", "proposer=ngram"], "build",
     "which is not installed: ", None),
    ("server setting out of range", [*SYN, "server.port=70000"], "serve",
     "server.port=70000 is out of range [0, 65535]; give a TCP port", None),
    ("server host that is not an address", [*SYN, "server.host=256.1.1.1"], "serve",
     "server.host='256.1.1.1' is not a valid IP address", None),
    ("server port in use", [*SYN, "server.port={port}"], "serve_bind",
     "is already in use (another server?); stop that process or pick a free port", None),
    ("vLLM missing", ["engine=vllm", "proposer=ngram"], "folder_run",
     "engine=vllm needs vLLM, which is not importable here", None),
    ("a proposer vLLM cannot host", ["engine=vllm", "vllm.drafter=specflow", "proposer=draft"],
     "folder_run", "proposer=draft needs a draft model, which specflow cannot run inside vLLM; "
     "use vLLM's own draft-model speculation", None),
    ("a policy only specflow runs, on vLLM's own method",
     ["engine=vllm", "proposer=ngram", "policy=adaptive"], "folder_run",
     "policy=adaptive runs inside vLLM only as specflow's drafter", None),
    ("a config vLLM refuses", ["engine=vllm", "proposer=none", "model.max_model_len=100000"],
     "folder_run", "vLLM refused this arm (ValidationError", None),
    ("a bad SPECFLOW_VLLM_OVERRIDES in vLLM's own LLM or vllm serve", ["proposer=ngarm"],
     "vllm_front_end", "Could not find 'proposer/ngarm'; valid options for proposer: draft, "
     "eagle, ngram, none", None),
    ("a folder of GGUF files", ["model=hf", "model.path={tmp}/two-ggufs", "proposer=ngram"],
     "build", "has no config.json but holds GGUF files (a.Q4_0.gguf, b.Q8_0.gguf); point "
     "model.path at the one to load, e.g. model.path=", None),
    ("the demo draft under another target", ["model=hf", "model.path={draft}"], "build",
     "proposer=draft (the default proposer) needs a draft model with the target's tokenizer, "
     "and none ships for model.path=", None),
    ("a transformers prompt longer than the context", ["proposer=none", "model.max_model_len=4",
                                                       "prompt=abcdefghij"],
     "generate:['abcdefghij']", "has 5 tokens but the model's context is 4; shorten the prompt",
     None),
    ("unknown chat setting", [*SYN, "chat=yes"], "compose",
     "chat='yes'; use auto (wrap prompt= in the tokenizer's chat template when it has one), on "
     "or off", None),
    ("retime not true or false", [*SYN, "retime=sometimes"], "compose",
     "retime='sometimes'; use false (read back the times that the choices at start measured in "
     "an earlier run on this machine) or true (time them again)", None),
    ("an int4 group size with no kernel", ["dtype=int4", "model.group_size=48", "proposer=none"],
     "compose", "model.group_size=48; use 32, 64, 128 or 256 (weights per int4 scale)", None),
    ("an int4 group size that does not divide a width",
     ["dtype=int4", "model.group_size=256", "proposer=none", "draft=none"], "build",
     "model.group_size=256 does not divide the intermediate width 1408", None),
    ("proposer=self over a model it cannot copy", [*SYN, "proposer=self"], "build",
     "proposer=self drafts with the target's own weights in int4 or int8 and needs a "
     "transformers target (model=hf, model=demo or model=smollm2)", None),
    ("an unknown prefill for proposer=self", ["proposer=self", "proposer.prefill=mine"],
     "compose", "proposer.prefill='mine'; use target (copy the target's cached prompt) or own "
     "(the draft's own prefill)", None),
    ("a draft vocabulary of no tokens", ["proposer=self", "proposer.draft_vocab=0"],
     "compose", "proposer.draft_vocab=0; use auto, null (every token) or a count (>= 1) of the "
     "vocabulary's first token ids", None),
]


def _fill(arg: str, tmp: pathlib.Path, port: int | None = None) -> str:
    if "{draft}" in arg:
        arg = arg.replace("{draft}", _mismatched_draft(tmp))
    return arg.replace("{tmp}", str(tmp)).replace("{port}", str(port))


@pytest.fixture
def taken_port():
    """{port}: a port another socket listens on (closed whatever happens)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _skip_cuda(name):
    if name == "CUDA without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    import importlib.util

    has_vllm = importlib.util.find_spec("vllm") is not None
    if name == "vLLM missing" and has_vllm:
        pytest.skip("vLLM is installed here")
    if name == "a config vLLM refuses" and not has_vllm:
        pytest.skip("needs vLLM: `make test-vllm` runs it")


def _vllm_serve_refuses(tmp_path: pathlib.Path, overrides: list[str], line: str) -> None:
    """`vllm serve` with specflow's drafter and bad overrides: exit 2 and the one line, from
    vLLM's front end (specflow's vLLM plugin), before an engine process starts."""
    import json

    pytest.importorskip("vllm")
    from vllm_support.test_in_vllm import VLLM_COMMAND

    from specflow.backends.hf.backend import DEMO_DIR

    command = tmp_path / "vllm_command.py"
    command.write_text(VLLM_COMMAND, encoding="utf-8")
    env = {**os.environ, "SPECFLOW_VLLM_OVERRIDES": " ".join(overrides),
           "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(
        [sys.executable, str(command), "serve", str(DEMO_DIR / "target"), "--enforce-eager",
         "--dtype", "float32", "--speculative-config",
         json.dumps({"method": "custom_class", "model": "specflow.vllm.SpecflowProposer",
                     "num_speculative_tokens": 3})],
        capture_output=True, text=True, env=env, timeout=300)
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert last.startswith("specflow: error:") and line in last, last
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize("name,args,api,cli_msg,api_msg", ROWS, ids=[r[0] for r in ROWS])
def test_cli(tmp_path, request, name, args, api, cli_msg, api_msg):
    _skip_cuda(name)
    if api == "vllm_front_end":
        return _vllm_serve_refuses(tmp_path, args, cli_msg)
    _files(tmp_path)
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if api == "plugin":
        env.pop("SPECFLOW_DISABLE_PLUGIN_AUTOLOAD")
        env["PYTHONPATH"] = str(_install_raising_plugin(tmp_path))
    port = request.getfixturevalue("taken_port") if api == "serve_bind" else None
    args = [_fill(a, tmp_path, port) for a in args]
    command = "serve" if api.startswith("serve") else "run"     # a server that starts is killed
    out = subprocess.run([SPECFLOW, command, *args, "max_new_tokens=8",
                          f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, capture_output=True,
                         env=env, timeout=300)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, (out.returncode, err)
    assert err.startswith("specflow: error:") and cli_msg in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run/metrics.json").exists()


@pytest.fixture
def raising_plugin(tmp_path, monkeypatch):
    from specflow import plugins
    monkeypatch.syspath_prepend(str(_install_raising_plugin(tmp_path)))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    plugins.reset()
    yield
    plugins.reset()
    sys.modules.pop("fake_specflow_boom", None)


@pytest.mark.parametrize("name,args,api,cli_msg,api_msg", ROWS, ids=[r[0] for r in ROWS])
def test_api(tmp_path, request, name, args, api, cli_msg, api_msg):
    _skip_cuda(name)
    _files(tmp_path)
    port = request.getfixturevalue("taken_port") if api == "serve_bind" else None
    args = [_fill(a, tmp_path, port) for a in args]
    message = api_msg or cli_msg
    with pytest.raises(SpecflowError) as info:
        if api == "compose":
            compose(args)
        elif api == "serve":
            compose(args, "serve")
        elif api == "serve_bind":     # `specflow serve` binds its address before the model loads
            from specflow.serving.app import bind_socket
            cfg = compose(args, "serve")
            bind_socket(str(cfg.server.host), int(cfg.server.port)).close()
        elif api.startswith("generate_sampling:"):     # a request's own sampling values
            sampling = eval(api.split(":", 1)[1])      # noqa: S307 - literals from the table above
            Pipeline.from_config([*SYN, "logits=[top_k]"]).generate(["abc"], sampling=sampling,
                                                                     max_new_tokens=8)
        elif api == "build":
            Pipeline.from_config(args)
        elif api == "vllm_front_end":  # what specflow's vLLM plugin checks (no vLLM needed)
            from specflow.vllm.plugin import check_vllm_config
            from specflow.vllm.testing import vllm_config
            request.getfixturevalue("monkeypatch").setenv("SPECFLOW_VLLM_OVERRIDES",
                                                          " ".join(args))
            check_vllm_config(vllm_config())
        elif api == "folder_run":      # engine=vllm runs go through the app layer
            from specflow.app.folder_run import run_into
            run_into(compose(args), tmp_path / "run", owner="test", setting="hydra.run.dir",
                     rerun="rerun", progress=False, replace_finished=True)
        elif api.startswith("prompt_file:"):
            from specflow.experiments.workloads import read_prompt_file
            read_prompt_file(_fill(api.split(":", 1)[1], tmp_path))
        elif api == "plugin":
            request.getfixturevalue("raising_plugin")
            Pipeline.from_config(args).generate(["abc"], max_new_tokens=8)
        elif api.startswith("generate_kw:"):     # a bad generate() argument, on a good pipeline
            kwargs = eval(api.split(":", 1)[1])      # noqa: S307 - literals from the table above
            Pipeline.from_config(SYN).generate(["abc"], **{"max_new_tokens": 8, **kwargs})
        else:
            kind, value = api.split(":", 1)
            prompts = eval(value)       # noqa: S307 - literals from the table above
            keep = [a for a in args if not a.startswith(("prompt=", "stop.strings="))]
            pipe = Pipeline.from_config(keep)
            if kind == "generate_stop":
                pipe.generate(["abc"], stop=prompts, max_new_tokens=8)
            else:
                pipe.generate(prompts, max_new_tokens=8)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert info.value.exit_code == 2


PAGE = ROOT / "docs" / "bad-input.md"     # the README links to it


def test_the_docs_table_is_this_table():
    page = PAGE.read_text(encoding="utf-8")
    section = page.split("# Bad input", 1)[1].split("\n## ", 1)[0]
    section = section.split("## Output folders and sweeps", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]   # no header
    assert len(rows) == len(ROWS)
    for line, (name, *_rest, cli_msg, _api_msg) in zip(rows, ROWS):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == name, (cells[0], name)
        assert cli_msg in line.replace("\\|", "|"), (name, cli_msg)


# the second table, "Output folders and sweeps": rows that are about files and folders, each
# tested where its setting lives (the file named in the row's last cell)
def test_the_docs_folder_table_is_tested_where_it_says():
    page = PAGE.read_text(encoding="utf-8")
    section = page.split("# Bad input", 1)[1]
    table = section.split("## Output folders and sweeps", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) >= 8
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        message, test_file = cells[2].strip("`"), cells[3].strip("`")
        source = (ROOT / test_file).read_text(encoding="utf-8")
        assert message in source, (cells[0], message, test_file)
