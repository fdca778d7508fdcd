"""`specflow serve` under load: requests/s, time to first token and inter-token latency.

For each arm (proposer=none, proposer=draft with policy=goodput by default) this starts a server
on 127.0.0.1 and sends streaming /v1/completions requests (held-out code prompts of the demo
pair, greedy) at concurrency 1, 4 and 16, closed loop (each client sends its next request when
the last one ends). Per request it records time to first token (TTFT), the gaps between streamed
chunks (ITL; one chunk may carry several tokens under speculation), time per output token after
the first (TPOT), and whether it failed or was lost (no final chunk). Prints a table, writes
bench/results/serve_load.{json,md} and says where speculation stops paying.

    python bench/serve_load.py                       # the demo pair, 2 threads
    python bench/serve_load.py --requests 500 --concurrency 16   # the long run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specflow.experiments.workloads import read_prompt_file  # noqa: E402
from specflow.io import atomic_write_json, atomic_write_text  # noqa: E402
from specflow.backends.hf.backend import DEMO_DIR  # noqa: E402
from specflow.backends.choice_cache import retime_unless_told  # noqa: E402

SPECFLOW = str(pathlib.Path(sys.executable).with_name("specflow"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(overrides: list[str], threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    proc = subprocess.Popen(
        [SPECFLOW, "serve", *overrides, f"threads={threads}", f"max_batch_size={max_batch}",
         f"server.port={port}", "server.max_queue=1024", "hydra.run.dir=/tmp/specflow-serve-load",
         "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up in 120 s")


async def one(client, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "specflow", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, tokens, finished, error = [], 0, False, None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"failed": True, "error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]["message"]
                    continue
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                for ch in data.get("choices", []):
                    if ch.get("text"):
                        stamps.append(time.perf_counter())
                    if ch.get("finish_reason"):
                        finished = True
    except Exception as exc:       # noqa: BLE001 - counted as failed
        return {"failed": True, "error": str(exc)}
    end = time.perf_counter()
    if error or not finished:
        return {"failed": bool(error), "lost": not finished and not error, "error": error}
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"failed": False, "lost": False, "ttft": (stamps[0] if stamps else end) - start,
            "itl": gaps, "tpot": (end - stamps[0]) / max(1, tokens - 1) if stamps else 0.0,
            "tokens": tokens, "latency": end - start}


async def level(url: str, prompts: list[str], concurrency: int, requests: int,
                max_tokens: int) -> dict:
    import httpx

    todo = iter(range(requests))
    results = []

    async def client_loop(client):
        for i in todo:
            results.append(await one(client, url, prompts[i % len(prompts)], max_tokens))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ok = [r for r in results if not r.get("failed") and not r.get("lost")]
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] * 1e3 if len(xs) > 1 else (  # noqa: E731
        xs[0] * 1e3 if xs else float("nan"))
    itl = [g for r in ok for g in r["itl"]]
    return {"concurrency": concurrency, "requests": requests, "ok": len(ok),
            "failed": sum(1 for r in results if r.get("failed")),
            "lost": requests - len(results) + sum(1 for r in results if r.get("lost")),
            "requests_per_s": len(ok) / wall, "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_ms": pct([r["ttft"] for r in ok], 50),
            "ttft_p99_ms": pct([r["ttft"] for r in ok], 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "tpot_p50_ms": pct([r["tpot"] for r in ok], 50),
            "tpot_p99_ms": pct([r["tpot"] for r in ok], 99), "wall_s": wall}


def render(env: dict, rows: list[dict]) -> str:
    lines = [f"specflow serve on the demo pair, {env['threads']} CPU threads, "
             f"{env['max_tokens']} new tokens per request, greedy, streaming, closed loop. "
             f"ITL = gap between streamed chunks (a chunk may carry several tokens); TPOT = time "
             f"per output token after the first.", "",
             "| arm | concurrency | requests | failed | lost | requests/s | tokens/s | TTFT p50 / "
             "p99 ms | ITL p50 / p99 ms | TPOT p50 / p99 ms | tokens/s vs none |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['arm']} | {r['concurrency']} | {r['requests']} | {r['failed']} | "
                     f"{r['lost']} | {r['requests_per_s']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} / "
                     f"{r['itl_p99_ms']:.1f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f} | "
                     f"{r.get('vs_none', float('nan')):.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    retime_unless_told()     # choices kept from a busy machine would distort the arms
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="none:proposer=none,draft:proposer=draft policy=goodput",
                    help="name:overrides pairs, comma-separated")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests per level (default: 8 x concurrency, at least 16)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="serve_load")
    args = ap.parse_args()
    prompts = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"), "prompt")
    levels = [int(c) for c in args.concurrency.split(",")]
    arms = [a.split(":", 1) for a in args.arms.split(",")]
    rows = []
    for name, overrides in arms:
        proc, url = start(overrides.split(), args.threads, max(levels))
        try:
            for c in levels:
                n = args.requests or max(16, 8 * c)
                row = {"arm": name, **asyncio.run(level(url, prompts, c, n, args.max_tokens))}
                print(json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in row.items()}), flush=True)
                rows.append(row)
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(120)
            if code != 0:
                print(f"{name}: the server exited {code} on SIGTERM", file=sys.stderr)
    for r in rows:
        base = next((x for x in rows if x["arm"] == arms[0][0]
                     and x["concurrency"] == r["concurrency"]), None)
        r["vs_none"] = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    env = {"threads": args.threads, "max_tokens": args.max_tokens, "cpu": os.cpu_count()}
    md = render(env, rows)
    speculative = [r for r in rows if r["arm"] != arms[0][0]]
    losing = sorted({r["concurrency"] for r in speculative if r["vs_none"] < 1.0})
    md += ("\nSpeculation stops paying at concurrency " + str(losing[0]) + "." if losing else
           "\nSpeculation pays at every concurrency measured.") + "\n"
    out = pathlib.Path(args.out)
    atomic_write_json(out / f"{args.name}.json", {"env": env, "rows": rows})
    atomic_write_text(out / f"{args.name}.md", md)
    print(md)


if __name__ == "__main__":
    main()
