"""`make bench-real`: SmolLM2-135M-Instruct, a real model whose pass is bound by reading its
weights, against HF generate on the same weights and prompts, in one run (`--model demo`: the
same arms on the demo pair, 12 held-out code prompts, against llama.cpp on the demo target).

Greedy, fp32, batch 1, 12 held-out prompts (6 code from the demo prompt file, 6 chat from
MT-Bench through the model's chat template) x 128 new tokens, arms interleaved prompt by prompt:
HF generate (at 1 and 2 threads, ratios against its faster), specflow none / ngram / ngram tree
/ eagle / eagle tree (the eagle arms when a head
is found: the shipped one or --head), and none in bfloat16 where the CPU has AMX or
AVX512-BF16; llama.cpp's plain decoding and its n-gram lookup (each at 1 and 2 threads, its default
OpenMP waits; ratios against its faster plain setting, which the table names) on the same
weights as an f32 GGUF, where `make llama-cpp` has built it (bench/llamacpp.py). Then `none` at
16 concurrent requests against batch 1, and `policy=goodput` at batch 1 and 16 (each batch size
run twice, in turns, the faster run kept). Writes
bench/results/real.{json,md} (real_demo.{json,md} for the demo pair).
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specflow import Pipeline  # noqa: E402
from specflow.console import console  # noqa: E402
from specflow.experiments.workloads import apply_chat_template, read_prompt_file  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402
from specflow.paths import DEMO_DIR, WEIGHTS_DIR  # noqa: E402
from specflow.backends.choice_cache import retime_unless_told  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from llamacpp import LlamaCpp  # noqa: E402

LLAMA_CPP = ROOT / "build" / "llama.cpp"

def chat_prompts(tokenizer, n: int) -> list[str]:
    """The last n MT-Bench first turns shipped in specflow/data, through the model's chat
    template (as workload=mt_bench wraps them)."""
    if n <= 0:
        return []
    rows = read_prompt_file(str(ROOT / "specflow" / "data" / "mt_bench_subset.jsonl"), "prompt")
    return apply_chat_template(rows[-n:], tokenizer, "on")


def held_out_prompts(tokenizer, n: int, code: int | None = None) -> list[str]:
    """n held-out prompts: `code` of them (half unless given) from the demo's code prompt file,
    the rest MT-Bench chat turns through the model's chat template."""
    code = n // 2 if code is None else code
    return (read_prompt_file(str(DEMO_DIR / "prompts.jsonl"), "prompt")[:code]
            + chat_prompts(tokenizer, n - code))


class Peer:
    """What a peer's process reports: its text (compared as text with none's), the tokens it
    decoded and its own seconds."""

    def __init__(self, text: str, count: int, seconds: float):
        self.text, self.count, self.seconds = text, count, seconds


def llama_plain(peer: LlamaCpp, n: int):
    def run(prompt):
        text, count, seconds = peer.plain(prompt, n)
        return None, Peer(text, count, seconds)
    return run


def llama_lookup(peer: LlamaCpp, n: int, k: int):
    def run(prompt):
        text, count, seconds = peer.lookup(prompt, n, k)
        start = text.find(prompt[-40:])             # it echoes the prompt: the text after it
        return None, Peer(text[start + len(prompt[-40:]):] if start >= 0 else text, count,
                          seconds)
    return run


def bf16_cpu() -> bool:
    try:
        flags = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def main() -> None:
    retime_unless_told()     # choices kept from a busy machine would distort the arms
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "demo"), default="smollm2")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--head", default=None, help="an EAGLE-3 head folder for SmolLM2")
    ap.add_argument("--llama-cpp", default=str(LLAMA_CPP / "build" / "bin"),
                    help="llama.cpp's binaries (make llama-cpp); skipped when absent")
    ap.add_argument("--llama-gguf", default=None,
                    help="the same weights as an f32 GGUF (default: make llama-cpp's)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    N = args.new_tokens
    demo = args.model == "demo"
    gguf = args.llama_gguf or str(LLAMA_CPP / f"{args.model}-f32.gguf")
    base = [f"model={args.model}", "show_progress=false", f"threads={args.threads}"]
    plain = Pipeline.from_config([*base, "proposer=none", "max_batch_size=1"])
    tok, model = plain.tokenizer.tok, plain.target.model
    half = args.prompts if demo else args.prompts // 2   # the demo target has no chat template
    prompts = held_out_prompts(plain.tokenizer, args.prompts, code=half)

    head = args.head or str(WEIGHTS_DIR / args.model / "eagle")     # the shipped head
    have_head = (pathlib.Path(head) / "config.json").is_file()
    k = args.k
    sf_arms = {"specflow none": ["proposer=none"],
               "specflow ngram": ["proposer=ngram", f"proposer.k={k}"],
               "specflow ngram tree": ["proposer=ngram", f"proposer.k={k}", "proposer.topk=4",
                                       "proposer.num_draft_tokens=16"]}
    if have_head:
        sf_arms["specflow eagle"] = ["proposer=eagle", f"proposer.path={head}", f"proposer.k={k}"]
        sf_arms["specflow eagle tree"] = ["proposer=eagle", f"proposer.path={head}",
                                          f"proposer.k={k}", "proposer.topk=4",
                                          "proposer.num_draft_tokens=16"]
        sf_arms["specflow eagle goodput"] = ["proposer=eagle", f"proposer.path={head}",
                                             "policy=goodput", f"policy.k_max={2 * k}"]
    if bf16_cpu():
        sf_arms["specflow none bf16"] = ["proposer=none", "dtype=bfloat16"]
    pipes = {name: plain if name == "specflow none" else
             Pipeline.from_config([*base, "max_batch_size=1", *over])
             for name, over in sf_arms.items()}

    def hf_at(threads: int):
        """HF generate at `threads` torch threads (each engine is timed at every thread count
        and compared at its best)."""
        def run(prompt):
            torch.set_num_threads(threads)
            return hf_run(prompt)
        return run

    def hf_run(prompt):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
        return out[0, ids.shape[1]:].tolist(), None

    def sf(name):
        def run(prompt):
            torch.set_num_threads(args.threads)       # an HF arm may have set another count
            r = pipes[name].generate([prompt], max_new_tokens=N, max_batch_size=1)[0]
            return r.token_ids, r.stats
        return run

    hf_threads = sorted({1, args.threads})
    arms = {**{f"HF generate ({t} thread{'s' if t > 1 else ''})": hf_at(t) for t in hf_threads},
            **{name: sf(name) for name in sf_arms}}
    if (pathlib.Path(args.llama_cpp) / "llama-completion").is_file():
        for t in sorted({1, args.threads}):     # every thread count: the best is compared
            threads = f"{t} thread{'s' if t > 1 else ''}"
            peer = LlamaCpp(args.llama_cpp, gguf, threads=t)
            arms[f"llama.cpp plain ({threads})"] = llama_plain(peer, N)
            arms[f"llama.cpp lookup ({threads})"] = llama_lookup(peer, N, k)
    else:
        console.print(f"[dim]no llama.cpp at {args.llama_cpp} (make llama-cpp): its arms are "
                      f"left out[/]")
    for fn in arms.values():            # warm-up
        fn(prompts[0][:100])
    outputs = {n: [] for n in arms}
    speeds = {n: [] for n in arms}
    stats = {n: [] for n in arms}
    for i, prompt in enumerate(prompts):
        for name, fn in arms.items():
            t = time.perf_counter()
            out, st = fn(prompt)
            seconds, count = time.perf_counter() - t, len(out or ())
            if isinstance(st, Peer):            # a peer process: the seconds it reports
                out, seconds, count, st = st.text, st.seconds, st.count, None
            speeds[name].append(count / seconds)
            outputs[name].append(out)
            if st:
                stats[name].append(st)
        console.print(f"[dim]prompt {i + 1}/{len(prompts)}[/]")
    ref = outputs["specflow none"]
    for name in arms:                   # a peer's text: the same as none's while it runs as long
        if name.startswith("llama.cpp"):
            outputs[name] = [ref_ids if text.startswith(tok.decode(ref_ids)) else None
                             for text, ref_ids in zip(outputs[name], ref)]
    none = statistics.median(speeds["specflow none"])
    hfs = {n: statistics.median(v) for n, v in speeds.items() if n.startswith("HF generate")}
    best_hf = max(hfs, key=hfs.get)                              # its faster thread count
    hf = hfs[best_hf]
    plains = {n: statistics.median(v) for n, v in speeds.items() if n.startswith("llama.cpp plain")}
    best_llama = max(plains, key=plains.get, default=None)      # its faster thread count
    llama = plains.get(best_llama)
    rows = []
    for name in arms:
        med = statistics.median(speeds[name])
        st = stats[name]
        passes = sum(s["num_target_passes"] for s in st)
        row = {"arm": name, "tokens_per_s": med, "vs_none": med / none, "vs_hf": med / hf,
               "vs_llama_cpp": med / llama if llama else None,
               "same_as_none": sum(a == b for a, b in zip(outputs[name], ref)) / len(ref),
               "code_tokens_per_s": statistics.median(speeds[name][:half]),
               "chat_tokens_per_s": statistics.median(speeds[name][half:])
               if half < len(prompts) else None}
        if passes:
            row["tau"] = sum(s["num_committed_tokens"] for s in st) / passes
        rows.append(row)

    batch_rows = []
    many = [prompts[i % len(prompts)] for i in range(16)]     # 16 requests, however many prompts
    for name, over in (("specflow none", ["proposer=none"]),
                       ("specflow goodput (ngram)", ["proposer=ngram", f"proposer.k={k}",
                                                    "policy=goodput"])):
        at = {b: Pipeline.from_config([*base, f"max_batch_size={b}", *over]) for b in (1, 16)}
        best: dict[int, dict] = {}
        # in turns, each batch size's faster run kept: this VM's memory speed drifts by the
        # minute (a streaming read measured 33 and 48 GB/s ten minutes apart)
        for b in (1, 16, 16, 1):
            t = time.perf_counter()
            res = at[b].generate(many, max_new_tokens=N // 2, max_batch_size=b)
            secs = time.perf_counter() - t
            tokens = sum(len(r.token_ids) for r in res)
            prefill = at[b].last_stats["seconds"]["prefill"]
            run = {"arm": name, "batch": b, "tokens_per_s": tokens / secs, "prefill_s": prefill,
                   "decode_tokens_per_s": tokens / max(secs - prefill, 1e-9)}
            if b not in best or run["tokens_per_s"] > best[b]["tokens_per_s"]:
                best[b] = run
            console.print(f"[dim]{name} batch {b}: {run['tokens_per_s']:.1f}[/]")
        batch_rows += [best[1], best[16]]
        del at

    env = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
           "torch": torch.__version__, "prompts": len(prompts), "new_tokens": N, "k": k,
           "head": head if have_head else None, "model": args.model,
           "llama_cpp_reference": best_llama, "hf_reference": best_hf}
    out = pathlib.Path(args.out)
    name = "real_demo" if demo else "real"
    atomic_write_json(out / f"{name}.json", {"env": env, "arms": rows, "batch": batch_rows})
    what = "The demo pair's target (fp32)" if demo else \
        "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)"
    lines = [f"{what}, cpu, {args.threads} threads,"
             f" torch {torch.__version__}; llama.cpp on the same weights as an f32 GGUF; "
             f"{len(prompts)} prompts ({half} code, "
             f"{len(prompts) - half} chat) x {N} new tokens, greedy, batch 1, k = {k}; medians "
             f"of per-prompt tokens/s, arms interleaved.", "",
             f"| arm | tokens/s | vs none | vs {best_hf} | vs {best_llama or 'llama.cpp plain'} | "
             f"code | chat | "
             "same output as none | τ |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        vs_llama = f"{r['vs_llama_cpp']:.2f}x" if r["vs_llama_cpp"] else "-"
        chat = "-" if r["chat_tokens_per_s"] is None else f"{r['chat_tokens_per_s']:.1f}"
        lines.append(f"| {r['arm']} | {r['tokens_per_s']:.1f} | {r['vs_none']:.2f}x | "
                     f"{r['vs_hf']:.2f}x | {vs_llama} | {r['code_tokens_per_s']:.1f} | "
                     f"{chat} | {r['same_as_none']:.0%} | {tau} |")
    lines += ["", f"| arm | batch | tokens/s (16 requests x {N // 2} tokens) | vs batch 1 | "
              f"prefill s | decoding tokens/s | vs batch 1 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in batch_rows:
        one = next(x for x in batch_rows if x["arm"] == r["arm"] and x["batch"] == 1)
        lines.append(f"| {r['arm']} | {r['batch']} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x | {r['prefill_s']:.2f} | "
                     f"{r['decode_tokens_per_s']:.1f} | "
                     f"{r['decode_tokens_per_s'] / one['decode_tokens_per_s']:.2f}x |")
    atomic_write_text(out / f"{name}.md", "\n".join(lines) + "\n")
    console.print("\n".join(lines))


if __name__ == "__main__":
    main()
