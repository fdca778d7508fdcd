"""backends/hf/tokenizers.py: a folder's tokenizer chosen from its config.json's fields (a
generic config view) is the one AutoTokenizer chooses from the model's own config class."""
from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specflow.backends.hf.tokenizers import compare_tokenizers, config_view, open_tokenizer


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2", "gpt_neox"])
def test_the_view_chooses_the_tokenizer_the_config_class_chooses(hf_models, arch):
    folder = str(hf_models[arch])
    view = config_view(folder)
    assert view is not None and view.model_type == json.loads(
        (hf_models[arch] / "config.json").read_text())["model_type"]
    mine = open_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert type(mine) is type(theirs)
    assert compare_tokenizers(mine, theirs) == []
    chat = [{"role": "user", "content": "hi there"}]
    if getattr(theirs, "chat_template", None):
        assert mine.apply_chat_template(chat, tokenize=False) == \
            theirs.apply_chat_template(chat, tokenize=False)


def test_no_view_where_the_folder_names_remote_code_or_no_tokenizer_class(hf_models, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(hf_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "x.Y"}}))
    assert config_view(str(folder)) is None
    (folder / "config.json").write_text(json.dumps(config))
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok.pop("tokenizer_class", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    assert config_view(str(folder)) is None
    assert config_view(str(tmp_path / "absent")) is None
