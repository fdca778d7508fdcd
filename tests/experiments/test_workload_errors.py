"""Prompt files whose lines have the wrong shape: one line naming the file, the line number and
the JSON type found (InputError, exit 2); a value is never turned into a string."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from specflow import InputError
from specflow.experiments.workloads import read_prompt_file

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
SYN = ["model=synthetic", "draft=synthetic"]
GOOD = '{"prompt": "def f(x):"}'

# (the second line of a JSONL file, message substring after "<file>:2: ")
BAD_LINES = [
    ("[1, 2]", "a JSON array ([1, 2]), not an object"),
    ('"just text"', 'a JSON string ("just text"), not an object'),
    ("7", "a JSON number (7), not an object"),
    ("null", "a JSON null, not an object"),
    ('{"prompt": null}', "field 'prompt' is a JSON null, not a string"),
    ('{"prompt": 123}', "field 'prompt' is a JSON number (123), not a string"),
    ('{"prompt": true}', "field 'prompt' is a JSON boolean (true), not a string"),
    ('{"prompt": {"text": "hi"}}', "field 'prompt' is a JSON object"),
    ('{"prompt": []}', "field 'prompt' is an empty array"),
    ('{"prompt": [1, "x"]}', "field 'prompt[0]' is a JSON number (1), not a string"),
    ('{"other": "x"}', "no field 'prompt' (fields: other); set workload.field"),
]


def _jsonl(tmp_path: pathlib.Path, *lines: str, name: str = "p.jsonl") -> pathlib.Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _one_line(exc: BaseException, *parts: str) -> None:
    text = str(exc)
    assert "\n" not in text and exc.exit_code == 2, text
    for part in parts:
        assert part in text, text


@pytest.mark.parametrize("line,message", BAD_LINES, ids=[b[0] for b in BAD_LINES])
def test_a_bad_jsonl_line_is_refused_with_file_line_and_type(tmp_path, line, message):
    path = _jsonl(tmp_path, GOOD, line)
    with pytest.raises(InputError) as info:
        read_prompt_file(str(path), "prompt")
    _one_line(info.value, f"{path}:2: {message}")


def test_through_the_workload_config(tmp_path):
    path = _jsonl(tmp_path, GOOD, '{"prompt": 123}')
    from specflow.config import compose, option
    from specflow.plugins import get_registry

    node = option(compose([*SYN, "workload=file", f"workload.path={path}"]), "workload")
    with pytest.raises(InputError) as info:
        get_registry().get("workload", node.name).factory(node, None).prompts()
    _one_line(info.value, f"{path}:2: field 'prompt' is a JSON number (123)")


def test_lines_after_the_limit_are_not_read(tmp_path):
    path = _jsonl(tmp_path, GOOD, "[1, 2]")
    assert read_prompt_file(str(path), "prompt", limit=1) == ["def f(x):"]


def test_list_fields_still_take_their_first_string(tmp_path):
    path = _jsonl(tmp_path, '{"turns": ["first", "second"]}')
    assert read_prompt_file(str(path), "turns") == ["first"]


def test_where_on_a_line_that_is_not_an_object(tmp_path):
    path = _jsonl(tmp_path, '{"prompt": "a", "category": "qa"}', "[1, 2]")
    with pytest.raises(InputError) as info:
        read_prompt_file(str(path), "prompt", where={"category": "qa"})
    _one_line(info.value, f"{path}:2: a JSON array")


def test_where_on_a_field_no_row_has(tmp_path):
    path = _jsonl(tmp_path, '{"prompt": "a", "category": "qa"}')
    with pytest.raises(InputError) as info:
        read_prompt_file(str(path), "prompt", where={"categry": "qa"})
    _one_line(info.value, "no row has the field 'categry' that workload.where filters on "
                          "(fields: category, prompt); fix workload.where")


def test_where_skips_rows_without_the_field_rather_than_matching_none(tmp_path):
    path = _jsonl(tmp_path, '{"prompt": "a", "category": "qa"}', '{"prompt": "b"}',
                  '{"prompt": "c", "category": "None"}')
    assert read_prompt_file(str(path), "prompt", where={"category": "qa"}) == ["a"]
    assert read_prompt_file(str(path), "prompt", where={"category": "None"}) == ["c"]
    # a bad value in a row the filter skips is not read; in a kept row it is refused
    path = _jsonl(tmp_path, '{"prompt": 1, "category": "x"}', '{"prompt": "b", "category": "qa"}',
                  name="q.jsonl")
    assert read_prompt_file(str(path), "prompt", where={"category": "qa"}) == ["b"]
    with pytest.raises(InputError, match=r"q.jsonl:1: field 'prompt' is a JSON number"):
        read_prompt_file(str(path), "prompt", where={"category": "x"})


def test_where_on_a_text_file_is_refused(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("one\ntwo\n")
    with pytest.raises(InputError) as info:
        read_prompt_file(str(path), where={"category": "qa"})
    _one_line(info.value, "needs a JSONL file", "p.txt")


def test_text_files_take_every_line_as_it_is(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('[1, 2]\n{"prompt": null}\n\n123\n')
    assert read_prompt_file(str(path)) == ['[1, 2]', '{"prompt": null}', "123"]


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a"}).encode() + b"\n")
    assert read_prompt_file(str(path)) == ["a"]
    text = tmp_path / "p.txt"
    text.write_bytes(b"\xef\xbb\xbfhello\n")
    assert read_prompt_file(str(text)) == ["hello"]
    text.write_bytes(b"\xef\xbb\xbfcaf\xe9\n")
    with pytest.raises(InputError, match=r"bad byte at offset 6\)"):     # offsets count the mark
        read_prompt_file(str(text))


def test_cli_a_null_prompt_is_one_line(tmp_path):
    path = _jsonl(tmp_path, GOOD, '{"prompt": null}')
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    out = subprocess.run([SPECFLOW, "run", *SYN, "workload=file", f"workload.path={path}",
                          "workload.field=prompt", f"hydra.run.dir={tmp_path}/run",
                          "max_new_tokens=4"], cwd=tmp_path, capture_output=True, env=env,
                         timeout=300)
    err = out.stderr.decode().strip()
    assert out.returncode == 2, (out.returncode, err)
    assert err.startswith("specflow: error:") and len(err.splitlines()) == 1, err
    assert f"{path}:2: field 'prompt' is a JSON null, not a string" in err
    assert not (tmp_path / "run/metrics.json").exists()
