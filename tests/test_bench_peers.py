"""The benchmarks' peer arms run at their own best settings: llama.cpp gets none of this
process's OpenMP tuning (OMP_WAIT_POLICY=passive made its 2 threads slower than 1 here), and its
own timings are read back as the harness reports them."""
from __future__ import annotations

import json
import pathlib
import stat
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

from llamacpp import LlamaCpp  # noqa: E402

STDERR = ("prompt eval time =      12.50 ms /     5 tokens\\n"
          "       eval time =     250.00 ms /    31 runs\\n")


@pytest.fixture
def fake_llama(tmp_path):
    """A llama-completion and a llama-lookup that write their environment and arguments to
    seen.json and print llama.cpp's timing lines."""
    seen = tmp_path / "seen.json"
    for tool in ("llama-completion", "llama-lookup"):
        script = tmp_path / tool
        script.write_text(f"#!{sys.executable}\n"
                          "import json, os, sys\n"
                          f"json.dump({{'env': dict(os.environ), 'argv': sys.argv}}, open({str(seen)!r}, 'w'))\n"
                          "print('generated text')\n"
                          f"sys.stderr.write(\"{STDERR}\")\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    return tmp_path, gguf, seen


def test_llama_cpp_runs_without_this_processs_openmp_tuning(fake_llama, monkeypatch):
    bin_dir, gguf, seen = fake_llama
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.setenv("KMP_BLOCKTIME", "0")
    text, count, prompt_s, decode_s = LlamaCpp(str(bin_dir), str(gguf), threads=2).plain_timed(
        "hello", 32)
    recorded = json.loads(seen.read_text())
    assert not any(k.startswith(("OMP_", "GOMP_", "KMP_")) for k in recorded["env"])
    assert recorded["argv"][recorded["argv"].index("-t") + 1] == "2"
    assert (text.strip(), count, prompt_s, decode_s) == ("generated text", 32, 0.0125, 0.25)


def test_peer_arms_list_one_thread_and_the_bench_s_threads_each_file_and_lookup_where_asked(
        fake_llama, monkeypatch):
    from precision import peer_arms

    bin_dir, gguf, seen = fake_llama
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    arms = peer_arms(str(bin_dir), {"Q4_1": str(gguf), "bf16": str(gguf),
                                    "gone": str(bin_dir / "missing.gguf")}, 32, 2, lookup=("Q4_1",))
    assert sorted(arms) == ["llama.cpp Q4_1 lookup (1t)", "llama.cpp Q4_1 lookup (2t)",
                            "llama.cpp Q4_1 plain (1t)", "llama.cpp Q4_1 plain (2t)",
                            "llama.cpp bf16 plain (1t)", "llama.cpp bf16 plain (2t)"]
    assert arms["llama.cpp bf16 plain (2t)"]("hello").count == 32
    recorded = json.loads(seen.read_text())
    assert recorded["argv"][recorded["argv"].index("-t") + 1] == "2"
    assert "OMP_WAIT_POLICY" not in recorded["env"]
    assert peer_arms(str(bin_dir / "nowhere"), {"Q4_1": str(gguf)}, 32, 2) == {}


def test_a_sampled_peer_gets_the_sampler_s_flags_and_a_split_character_is_no_crash(
        fake_llama):
    bin_dir, gguf, seen = fake_llama
    script = bin_dir / "llama-completion"     # a token that ends inside a UTF-8 character
    script.write_text(script.read_text().replace("print('generated text')",
                                                 "sys.stdout.buffer.write(b'caf\\xc3'); sys.stdout.flush()"))
    flags = ["--temp", "0.8", "--top-p", "0.9"]
    text, count, _, _ = LlamaCpp(str(bin_dir), str(gguf), sampling=flags).plain_timed("hi", 32)
    argv = json.loads(seen.read_text())["argv"]
    at = argv.index("--temp")
    assert argv[at:at + 4] == flags and argv.count("--temp") == 1       # not greedy's --temp 0
    assert text.startswith("caf") and count == 32
