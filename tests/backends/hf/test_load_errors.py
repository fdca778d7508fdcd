"""Model folders that exist but cannot load, and hub ids not in the local cache: one line that
names the folder or file and the fix (ConfigError, exit 2), never a traceback, never the network."""
from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys

import pytest

from specflow import ConfigError, Pipeline
from specflow.backends.hf.backend import DEMO_DIR

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
NGRAM = ["proposer=ngram"]          # a target alone: no draft is built


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: pathlib.Path, **changes) -> None:
    import json

    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Copies of the demo draft (3 MB), each damaged one way; and the demo target with a torn shard."""
    root = tmp_path_factory.mktemp("broken_models")
    draft = DEMO_DIR / "draft"
    out = {"empty": root / "empty"}
    out["empty"].mkdir()
    out["no_config"] = _copy(draft, root / "no_config")
    (out["no_config"] / "config.json").unlink()
    out["config_not_json"] = _copy(draft, root / "config_not_json")
    (out["config_not_json"] / "config.json").write_text('{"model_type": "llama",')
    out["config_array"] = _copy(draft, root / "config_array")
    (out["config_array"] / "config.json").write_text("[1, 2]")
    out["no_model_type"] = _copy(draft, root / "no_model_type")
    _edit_json(out["no_model_type"] / "config.json", model_type=None)
    out["unknown_model_type"] = _copy(draft, root / "unknown_model_type")
    _edit_json(out["unknown_model_type"] / "config.json", model_type="llamaa")
    out["garbage_weights"] = _copy(draft, root / "garbage_weights")
    (out["garbage_weights"] / "model.safetensors").write_bytes(os.urandom(4096))
    out["truncated_weights"] = _copy(draft, root / "truncated_weights")
    weights = out["truncated_weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100_000])
    out["no_weights"] = _copy(draft, root / "no_weights")
    (out["no_weights"] / "model.safetensors").unlink()
    out["no_tokenizer"] = _copy(draft, root / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out["no_tokenizer"] / name).unlink()
    out["bad_tokenizer"] = _copy(draft, root / "bad_tokenizer")
    (out["bad_tokenizer"] / "tokenizer.json").write_text("{}")
    out["shape_mismatch"] = _copy(draft, root / "shape_mismatch")
    _edit_json(out["shape_mismatch"] / "config.json", hidden_size=256)
    out["torn_shard"] = _copy(DEMO_DIR / "target", root / "torn_shard")
    shard = out["torn_shard"] / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:50_000])
    return out


# (damage, message substring)
CASES = [
    ("empty", "is an empty folder; point model.path at a folder that save_pretrained wrote"),
    ("no_config", "has no config.json, so it is not a saved model"),
    ("config_not_json", "config.json is not valid JSON (Expecting"),
    ("config_array", "config.json holds a JSON array, not an object"),
    ("no_model_type", "config.json has no model_type string"),
    ("unknown_model_type", "config.json has model_type='llamaa', which transformers"),
    ("garbage_weights", "model.safetensors is damaged (SafetensorError"),
    ("truncated_weights", "model.safetensors is damaged (SafetensorError"),
    ("no_weights", "cannot load model"),
    ("no_tokenizer", "has no tokenizer files"),
    ("bad_tokenizer", "cannot load the tokenizer of model"),
    ("torn_shard", "model-00002-of-00003.safetensors is damaged"),
    ("shape_mismatch", "the shapes of its weights do not match its config.json"),
]


def _one_line(exc: BaseException, *parts: str) -> None:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    for part in parts:
        assert part in text, text
    assert exc.exit_code == 2


@pytest.mark.parametrize("damage,message", CASES, ids=[c[0] for c in CASES])
def test_model_folder_that_cannot_load(broken, damage, message, capfd):
    path = broken[damage]
    with pytest.raises(ConfigError) as info:
        Pipeline.from_config(["model=hf", f"model.path={path}", *NGRAM])
    _one_line(info.value, message, f"{path}")
    assert "LOAD REPORT" not in capfd.readouterr().err     # transformers' table is held back


@pytest.mark.parametrize("damage,message", [
    ("empty", "draft.path="), ("config_not_json", "config.json is not valid JSON"),
    ("truncated_weights", "model.safetensors is damaged")], ids=["empty", "config", "weights"])
def test_draft_folder_that_cannot_load(broken, damage, message):
    with pytest.raises(ConfigError) as info:
        Pipeline.from_config(["draft=hf", f"draft.path={broken[damage]}"])
    _one_line(info.value, message, str(broken[damage]))


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup and connection is recorded and refused."""
    calls: list = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError("network use in a test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return calls


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> pathlib.Path:
    """An empty Hugging Face hub cache of this test's own."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.parametrize("role", ["model", "draft"])
def test_hub_id_not_in_the_cache_fails_at_once_without_the_network(hf_cache, no_network, role):
    overrides = (["model=hf", "model.path=nosuchorg/nosuchmodel", *NGRAM] if role == "model"
                 else ["draft=hf", "draft.path=nosuchorg/nosuchmodel"])
    with pytest.raises(ConfigError) as info:
        Pipeline.from_config(overrides)
    _one_line(info.value, f"{role}.path='nosuchorg/nosuchmodel' is not a local folder and not in "
                          f"the local Hugging Face cache ({hf_cache})",
              "nothing is downloaded at run time")
    assert no_network == []        # not one lookup: nothing waits on a retry


def test_hub_id_in_the_cache_loads_offline(hf_cache, no_network):
    repo = hf_cache / "models--localorg--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text("0123abcd")
    shutil.copytree(DEMO_DIR / "draft", repo / "snapshots/0123abcd")
    pipe = Pipeline.from_config(["model=hf", "model.path=localorg/tiny", *NGRAM])
    assert pipe.generate(["def f(x):"], max_new_tokens=2)[0].token_ids
    assert no_network == []


def test_cli_a_torn_weights_shard_is_one_line(broken, tmp_path):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([SPECFLOW, "run", "model=hf", f"model.path={broken['torn_shard']}",
                          *NGRAM, f"hydra.run.dir={tmp_path}/run", "max_new_tokens=4"],
                         cwd=tmp_path, capture_output=True, env=env, timeout=300)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, (out.returncode, err)
    assert err.startswith("specflow: error:") and len(err.splitlines()) == 1, err
    assert "model-00002-of-00003.safetensors is damaged" in err and "Traceback" not in err
    assert not (tmp_path / "run/metrics.json").exists()
