"""`make bench-sampling`: SmolLM2-135M-Instruct sampled (temperature 0.8, top-p 0.9, a seed a
request) as chat users run it, against llama.cpp sampling the same files with the same settings.

Batch 1, 12 held-out prompts (6 code, 6 MT-Bench chat turns through the chat template) x 128 new
tokens, arms interleaved prompt by prompt (bench/precision.py's harness). specflow: `none`,
`ngram` on the Q4_1 file's blocks; `none`, `self` on the bfloat16 target. llama.cpp (default
OpenMP waits, 1 and 2 threads, the faster taken): plain and `llama-lookup` on the Q4_1 file, plain
on its bf16 copy, with --temp 0.8 --top-p 0.9 and its other samplers off (--top-k 0 --min-p 0),
so both sample from the same distribution. Tokens/s with the prompt (wall) and decoding alone.
Writes bench/results/sampling.{json,md}.
"""
from __future__ import annotations

import pathlib
import platform
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from specflow import Pipeline  # noqa: E402
from specflow.backends.choice_cache import retime_unless_told  # noqa: E402
from specflow.backends.hf.gguf import package_file  # noqa: E402
from specflow.console import console  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402

from precision import (LLAMA_CPP, Q4_1, interleaved, peer_arms, smollm2_parser,  # noqa: E402
                       specflow_arm, summary)
from real import held_out_prompts  # noqa: E402

TEMPERATURE, TOP_P = 0.8, 0.9
SAMPLING = ["logits=[temperature,top_p]", f"logits.temperature.value={TEMPERATURE}",
            f"logits.top_p.p={TOP_P}", "seed=0"]
ARMS = {
    "none Q4_1 blocks": ["proposer=none", "dtype=auto"],
    "ngram Q4_1 blocks": ["proposer=ngram", "proposer.k=4", "dtype=auto"],
    "none bfloat16": ["proposer=none", "dtype=bfloat16"],
    "self bfloat16": ["proposer=self", "dtype=bfloat16"],
}
PEER_SAMPLING = ["--temp", str(TEMPERATURE), "--top-p", str(TOP_P), "--top-k", "0",
                 "--min-p", "0", "--seed", "0"]


def main() -> None:
    retime_unless_told()
    args = smollm2_parser(__doc__).parse_args()
    N, T = args.new_tokens, args.threads
    base = ["model=smollm2", "show_progress=false", f"threads={T}", "max_batch_size=1", *SAMPLING]
    pipes = {name: Pipeline.from_config([*base, *over]) for name, over in ARMS.items()}
    prompts = held_out_prompts(next(iter(pipes.values())).tokenizer, args.prompts)
    arms = {f"specflow {name}": specflow_arm(p, N, T) for name, p in pipes.items()}
    files = {"Q4_1": str(package_file(Q4_1)), "bf16": str(LLAMA_CPP / "smollm2-bf16.gguf")}
    arms.update(peer_arms(args.llama_cpp, files, N, T, lookup=("Q4_1",), sampling=PEER_SAMPLING))
    runs = interleaved(arms, prompts, "SmolLM2 sampled")
    rows = {name: summary(rs) for name, rs in runs.items()}
    for label in ("Q4_1 plain", "Q4_1 lookup", "bf16 plain"):    # the faster thread count
        found = {n: r for n, r in rows.items() if n.startswith(f"llama.cpp {label} (")}
        if found:
            best = max(found, key=lambda n: found[n]["tokens_per_s"])
            rows[f"llama.cpp {label} (best)"] = {**found[best], "threads": best[-3:-1]}
    env = {"machine": platform.processor() or platform.machine(), "threads": T,
           "prompts": len(prompts), "new_tokens": N, "temperature": TEMPERATURE, "top_p": TOP_P}
    out = pathlib.Path(args.out)
    atomic_write_json(out / "sampling.json", {"env": env, "rows": rows})
    text = render(env, rows)
    atomic_write_text(out / "sampling.md", text)
    console.print(text)


def render(env: dict, rows: dict) -> str:
    def ratio(a: str, b: str) -> str:
        if a in rows and b in rows:
            return f"{rows[a]['tokens_per_s'] / rows[b]['tokens_per_s']:.2f}x"
        return "-"

    lines = [f"# SmolLM2 sampled: temperature {env['temperature']}, top-p {env['top_p']}",
             "", f"{env['prompts']} prompts x {env['new_tokens']} tokens, batch 1, "
             f"{env['threads']} threads, arms interleaved (`python bench/sampling.py`).", "",
             "| arm | tokens/s | decoding alone | α | τ |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        cells = [f"{r[k]:.1f}" if k.endswith("_s") else f"{r[k]:.2f}" if r.get(k) is not None
                 else "-" for k in ("tokens_per_s", "decode_tokens_per_s", "alpha", "tau")]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    pairs = [("ngram vs none, Q4_1 blocks", "specflow ngram Q4_1 blocks", "specflow none Q4_1 blocks"),
             ("self vs none, bfloat16", "specflow self bfloat16", "specflow none bfloat16"),
             ("none Q4_1 blocks vs llama.cpp Q4_1 plain", "specflow none Q4_1 blocks",
              "llama.cpp Q4_1 plain (best)"),
             ("ngram Q4_1 blocks vs llama-lookup Q4_1", "specflow ngram Q4_1 blocks",
              "llama.cpp Q4_1 lookup (best)"),
             ("none bfloat16 vs llama.cpp bf16 plain", "specflow none bfloat16",
              "llama.cpp bf16 plain (best)"),
             ("self bfloat16 vs llama.cpp bf16 plain", "specflow self bfloat16",
              "llama.cpp bf16 plain (best)")]
    lines += ["", "| ratio | value |", "|---|---:|"]
    lines += [f"| {label} | {ratio(a, b)} |" for label, a, b in pairs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
