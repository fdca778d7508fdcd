"""A run folder belongs to one run: unique default folders, a lock against a second process, and
one line (exit 2) for a folder that cannot be written or a disk that fills up."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from specflow import InputError
from specflow.io import LOCK_NAME, JsonlWriter, folder_lock
from specflow.resume import run_resumable

SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")
SYN = ["model=synthetic", "draft=synthetic", "--quiet"]
PROMPTS = [f"prompt {i} " + "ab" * i for i in range(6)]


def _cli(*args, cwd, wait=True):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if wait:
        return subprocess.run([SPECFLOW, *args], cwd=cwd, capture_output=True, env=env,
                              timeout=300)
    return subprocess.Popen([SPECFLOW, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)


def _one_line(err: bytes) -> str:
    text = err.decode().strip()
    assert len(text.splitlines()) == 1 and "Traceback" not in text, text
    assert text.startswith("specflow: error: "), text
    return text


# --- unique default folders -----------------------------------------------------------------------

@pytest.mark.parametrize("config_name", ["config", "calibrate"])
def test_default_run_folders_differ_even_when_made_in_the_same_second(config_name):
    from hydra import compose, initialize_config_module

    import specflow.io  # noqa: F401 - registers ${specflow_unique:}

    with initialize_config_module(config_module="specflow.conf", version_base="1.3"):
        first = compose(config_name, return_hydra_config=True)
        second = compose(config_name, return_hydra_config=True)
    a, b = str(first.hydra.run.dir), str(second.hydra.run.dir)
    pattern = r"^outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-%d-[0-9a-f]{4}$" % os.getpid()
    assert re.match(pattern, a) and re.match(pattern, b), (a, b)
    assert a != b                                  # two runs, two folders, whatever the clock
    assert str(first.hydra.run.dir) == a           # one run reads one folder every time
    assert "RunFolderCheck" in first.hydra.callbacks.run_folder._target_


def test_two_runs_started_at_once_without_a_run_dir_keep_their_own_records(tmp_path):
    procs = [_cli("run", *SYN, f"prompt=run {i}", "max_new_tokens=4", cwd=tmp_path, wait=False)
             for i in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    folders = sorted(tmp_path.glob("outputs/*/*"))
    assert len(folders) == 2, folders
    prompts = set()
    for folder in folders:
        rows = [json.loads(x) for x in (folder / "requests.jsonl").read_text().splitlines()]
        assert len(rows) == 1 and (folder / "metrics.json").exists()
        prompts.add(rows[0]["prompt"])
    assert prompts == {"run 0", "run 1"}


# --- one process per folder -----------------------------------------------------------------------

# `specflow run` that writes its first request, then waits until the file GO exists
PAUSED_RUN = """
import os, sys, time
import specflow.io as io
real, go = io.JsonlWriter.write, sys.argv[1]
def write(self, obj):
    real(self, obj)
    while not os.path.exists(go):
        time.sleep(0.02)
io.JsonlWriter.write = write
from specflow.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_finishes(tmp_path):
    env = {**os.environ, "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD": "1"}
    go = tmp_path / "go"
    args = ["run", *SYN, "workload=file", f"workload.path={tmp_path}/prompts.txt",
            "max_new_tokens=6", f"hydra.run.dir={tmp_path}/run"]
    (tmp_path / "prompts.txt").write_text("".join(f"line {i}\n" for i in range(5)))
    first = subprocess.Popen([sys.executable, "-c", PAUSED_RUN, str(go), *args], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    jsonl = tmp_path / "run/requests.jsonl"
    t0 = time.time()
    while not (jsonl.exists() and jsonl.read_text().count("\n") >= 1):
        assert first.poll() is None and time.time() - t0 < 120, first.communicate()[1].decode()
        time.sleep(0.05)
    hydra_yaml = (tmp_path / "run/.hydra/config.yaml").read_text()
    second = _cli(*args[:-2], "max_new_tokens=5", args[-1], cwd=tmp_path)   # other overrides
    err = _one_line(second.stderr)
    assert second.returncode == 2
    assert f"{tmp_path}/run is in use by another specflow run (pid {first.pid})" in err, err
    assert "wait for it to finish, or choose another hydra.run.dir=" in err
    # refused before Hydra wrote anything there: the first run's config record is its own
    assert (tmp_path / "run/.hydra/config.yaml").read_text() == hydra_yaml
    go.touch()
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err.decode()
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == list(range(5))
    metrics = json.loads((tmp_path / "run/metrics.json").read_text())
    assert metrics["aggregate"]["num_committed_tokens"] == sum(len(r["token_ids"]) for r in rows)


def test_the_lock_is_released_on_exit_and_when_its_process_dies(tmp_path):
    run = tmp_path / "run"
    with folder_lock(run):
        assert (run / LOCK_NAME).read_text().strip() == str(os.getpid())
        with pytest.raises(InputError, match=r"is in use by another specflow run \(pid \d+\); "
                                             r"wait for it to finish, or choose another "
                                             r"hydra.run.dir=\.\.\."):
            with folder_lock(run):
                pass
    with folder_lock(run):          # released on exit
        pass
    code = (f"import os, signal; from specflow.io import folder_lock\n"
            f"with folder_lock({str(run)!r}):\n    os.kill(os.getpid(), signal.SIGKILL)")
    died = subprocess.run([sys.executable, "-c", code], timeout=120)
    assert died.returncode == -signal.SIGKILL
    with folder_lock(run):          # the kernel dropped the dead process's lock
        pass


# --- folders that cannot be written, a disk that fills up -----------------------------------------

def test_a_run_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "taken").write_text("a file\n")
    out = _cli("run", *SYN, "prompt=hi", f"hydra.run.dir={tmp_path}/taken", cwd=tmp_path)
    assert out.returncode == 2
    assert (f"cannot write to hydra.run.dir={tmp_path}/taken: it is a file, not a folder; choose "
            f"a folder you can write with hydra.run.dir=...") in _one_line(out.stderr)
    out = _cli("run", *SYN, "prompt=hi", f"hydra.run.dir={tmp_path}/taken/run", cwd=tmp_path)
    assert out.returncode == 2 and "a part of that path is a file" in _one_line(out.stderr)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_run_dir_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        out = _cli("run", *SYN, "prompt=hi", f"hydra.run.dir={ro}/run", cwd=tmp_path)
    finally:
        ro.chmod(0o755)
    assert out.returncode == 2
    assert f"cannot write to hydra.run.dir={ro}/run: Permission denied" in _one_line(out.stderr)


def test_a_full_disk_while_writing_requests_keeps_them_and_the_rerun_resumes(make_pipeline,
                                                                           tmp_path, monkeypatch):
    real = JsonlWriter.write
    lines = []

    def write(self, obj):
        if len(lines) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(self, obj)
        lines.append(obj)

    monkeypatch.setattr(JsonlWriter, "write", write)
    with pytest.raises(InputError) as info:
        run_resumable(make_pipeline("max_new_tokens=8"), PROMPTS, tmp_path, False)
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    assert (f"cannot write {tmp_path}/requests.jsonl (No space left on device); the 2 requests "
            f"finished before that are kept there: free some space, then rerun into the same "
            f"folder to resume") == message
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 2
    monkeypatch.setattr(JsonlWriter, "write", real)
    rows, _, resumed = run_resumable(make_pipeline("max_new_tokens=8"), PROMPTS, tmp_path, False)
    assert resumed == 2 and [r["index"] for r in rows] == list(range(6))


def test_a_full_disk_while_writing_metrics_is_one_line_and_the_rerun_finishes(tmp_path,
                                                                             monkeypatch, capsys):
    import specflow.io
    from specflow.cli import main

    real = specflow.io.atomic_write_json

    def full(path, obj):
        if str(path).endswith("metrics.json"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, obj)

    monkeypatch.setattr(sys, "argv", list(sys.argv))        # the CLI rewrites it for Hydra
    monkeypatch.setattr(specflow.io, "atomic_write_json", full)
    run = tmp_path / "run"
    args = ["run", *SYN, "prompt=hello", "max_new_tokens=4", f"hydra.run.dir={run}"]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (f"specflow: error: cannot write {run}/metrics.json (No space left on device); all 1 "
            f"requests are kept in {run}/requests.jsonl: free some space, then rerun the same "
            f"command with hydra.run.dir={run} to finish") in err
    assert not (run / "metrics.json").exists() and (run / "requests.jsonl").exists()
    monkeypatch.setattr(specflow.io, "atomic_write_json", real)
    assert main(args) == 0                  # the lock went with the failed run: no leak
    assert json.loads((run / "metrics.json").read_text())["resumed_requests"] == 1


def test_files_written_whole_have_ordinary_permissions(tmp_path):
    """A trial found model.safetensors 0600 beside 0644 files: every file specflow writes gets
    what open() gives under the umask (mkstemp alone gives 0600)."""
    import os
    import stat

    from specflow.io import atomic_write_json

    old = os.umask(0o022)
    try:
        path = atomic_write_json(tmp_path / "metrics.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
