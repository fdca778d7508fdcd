"""llama.cpp as a peer arm: plain decoding (`llama-completion`) and its n-gram lookup
(`llama-lookup`) on the same weights as an f32 GGUF, greedy (or with a sampler's flags), one prompt
per process.

`make llama-cpp` builds the binaries and converts SmolLM2's dequantized folder to
build/llama.cpp/smollm2-f32.gguf (about 5 minutes of both cores). Tokens per second count the
prompt's evaluation and the decoding, as specflow's arms do (the model's load is left out: it is
once per process here, once per pipeline there). Each tool runs with llama.cpp's default OpenMP
waits at every thread count the bench asks for; the bench compares with the fastest.
"""
from __future__ import annotations

import os
import pathlib
import re
import subprocess

PLAIN = re.compile(r"prompt eval time =\s*([\d.]+) ms.*?\n.*?eval time =\s*([\d.]+) ms /\s*(\d+) runs",
                   re.S)
LOOKUP = re.compile(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds.*?decoded\s+(\d+) tokens in\s+"
                    r"([\d.]+) seconds", re.S)


def peer_env() -> dict[str, str]:
    """This process's environment without its OpenMP tuning (OMP_*, GOMP_*, KMP_*): llama.cpp
    runs at its own defaults. With OMP_WAIT_POLICY=passive its 2 threads decoded slower than 1
    here, which handicapped the peer in every ratio taken against it."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}


class LlamaCpp:
    """The binaries in `bin_dir` running `gguf` with `threads` threads."""

    def __init__(self, bin_dir: str, gguf: str, threads: int = 1, context: int = 2048,
                 sampling: list[str] | None = None):
        self.bin = pathlib.Path(bin_dir)
        self.gguf = str(gguf)
        self.threads = threads
        self.context = context
        # the sampler's flags (greedy unless given: --temp 0)
        self.sampling = list(sampling) if sampling else ["--temp", "0"]
        for name in ("llama-completion", "llama-lookup"):
            if not (self.bin / name).is_file():
                raise SystemExit(f"--llama-cpp {bin_dir}: no {name} there; run make llama-cpp")
        if not pathlib.Path(gguf).is_file():
            raise SystemExit(f"--llama-gguf {gguf} is not a file; run make llama-cpp")

    def _run(self, tool: str, prompt: str, new_tokens: int, extra: list[str], timings):
        """-> (stdout, the `timings` regex's match in stderr). Once in a while a tool exits 0
        before printing its timings: such a run is retried once."""
        # -p, not -f: a prompt file loses its last newline (a chat prompt's, after
        # "assistant"); --no-escape keeps a code prompt's backslashes as they are
        env = peer_env()
        for _ in range(2):
            proc = subprocess.run(
                [str(self.bin / tool), "-m", self.gguf, "-p", prompt, "--no-escape",
                 "-n", str(new_tokens), *self.sampling, "-t", str(self.threads),
                 "-c", str(self.context), "--ignore-eos", *extra],
                # errors="replace": a sampled token may end inside a multi-byte character
                capture_output=True, text=True, errors="replace", env=env, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"{tool} exited {proc.returncode}: {proc.stderr[-400:]}")
            if (m := timings.search(proc.stderr)) is not None:
                return proc.stdout, m
        raise RuntimeError(f"{tool} printed no timings: {proc.stderr[-400:]}")

    def plain(self, prompt: str, new_tokens: int) -> tuple[str, int, float]:
        """(generated text, tokens, seconds of prompt evaluation + decoding)."""
        out, count, prompt_s, decode_s = self.plain_timed(prompt, new_tokens)
        return out, count, prompt_s + decode_s

    def plain_timed(self, prompt: str, new_tokens: int) -> tuple[str, int, float, float]:
        """(generated text, tokens, seconds of prompt evaluation, seconds of decoding)."""
        out, m = self._run("llama-completion", prompt, new_tokens,
                           ["-no-cnv", "--no-display-prompt"], PLAIN)
        return out, int(m.group(3)) + 1, float(m.group(1)) / 1e3, float(m.group(2)) / 1e3

    def lookup(self, prompt: str, new_tokens: int, draft_max: int) -> tuple[str, int, float]:
        """llama-lookup (prompt n-grams, at most draft_max drafted): (text with the prompt,
        tokens decoded, seconds encoding + decoding)."""
        out, count, encode_s, decode_s = self.lookup_timed(prompt, new_tokens, draft_max)
        return out, count, encode_s + decode_s

    def lookup_timed(self, prompt: str, new_tokens: int,
                     draft_max: int) -> tuple[str, int, float, float]:
        """llama-lookup: (text with the prompt, tokens decoded, seconds encoding, seconds
        decoding)."""
        out, m = self._run("llama-lookup", prompt, new_tokens,
                           ["--spec-draft-n-max", str(draft_max)], LOOKUP)
        return out, int(m.group(2)), float(m.group(1)), float(m.group(3))
