"""specflow on CUDA in one prepared run: speed against HF, greedy equality, pass cost (< 8 min).

Builds, with no download, a random-init Llama-style target of ~1B parameters (hidden 2048, 22
layers, GQA 32/4, the demo tokenizer's 8192-token vocabulary) and a ~120M draft that shares its
vocabulary: the target's embeddings, final norm, LM head and first two layers. The target's later
layers write small updates into the residual stream (their output projections are scaled down), so
the draft agrees with it often, as a trained draft would; a random pair would accept nothing.
Both run in bfloat16 on CUDA. Then:

1. batch 1, per prompt: HF `generate` (plain), HF assisted generation (the draft), specflow
   `proposer=none | draft | ngram` (k = 4) and a draft tree (topk 4, 16 nodes): tokens/s, ratios;
2. batch 8 and 32: HF batched `generate` (left-padded) and the three specflow arms;
3. greedy equality: specflow none against HF generate (batch 1), and draft / ngram against none
   at every batch, per prompt (in bf16 a position scored inside a wider pass may round
   differently, so a near-tie can flip: the report gives exact prompts and the common prefix);
4. the pass-cost table of bench/passcost.py on this GPU (target and draft, batch 1/8/32);
5. float32 exactness: the same pair in fp32, draft and ngram against plain, batch 1 and 8;
6. a profile of a target pass at contexts 64 and 512 (top ops by device and host time) and the
   synchronizing CUDA calls per round (torch.cuda.set_sync_debug_mode);
7. CUDA graphs (backends/lean/graph_step.py): `none graphs` and `draft graphs` arms in 1 and 2 (the
   target's chain passes and the draft's steps captured per bucket), and a target pass at
   contexts 64 / 512 / 1000 with graphs on and off. `--quick` (4 prompts x 64 tokens, batches 1
   and 8, no profile) fits the device budget with room for a rerun.

    python bench/gpu_check.py --out results/            # on a CUDA machine
    python bench/gpu_check.py --quick --out results/    # the same in under 8 minutes
    python bench/gpu_check.py --tiny --device cpu       # the same steps on tiny models (smoke test)
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import statistics
import sys
import tempfile
import time
import traceback

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
if importlib.util.find_spec("specflow") is not None and importlib.util.find_spec("specflow.conf") is None:
    sys.modules["specflow.conf"] = importlib.import_module("conf")   # a checkout not pip-installed

FULL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
            num_key_value_heads=4)
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2)
DRAFT_LAYERS = 2
RESULTS: dict = {}


def say(*parts) -> None:
    print(*parts, flush=True)


def section(name: str):
    """Run a step; a failure prints its traceback and the run goes on to the next step."""
    def wrap(fn):
        def run(*a, **kw):
            start = time.perf_counter()
            say(f"\n== {name}")
            try:
                out = fn(*a, **kw)
                say(f"== {name}: done in {time.perf_counter() - start:.1f} s")
                return out
            except Exception:
                say(f"== {name}: FAILED after {time.perf_counter() - start:.1f} s")
                traceback.print_exc()
                RESULTS.setdefault("failed", []).append(name)
                sys.stdout.flush()
                return None
        return run
    return wrap


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@section("build the pair")
def build_pair(folder: pathlib.Path, dims: dict, device, dtype) -> tuple[pathlib.Path, pathlib.Path]:
    import shutil

    import transformers as tf

    from specflow.backends.hf.backend import DEMO_DIR

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=8192, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, eos_token_id=0, bos_token_id=0, pad_token_id=0,
                         **dims)
    with torch.device(device):
        target = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():
        for layer in target.model.layers[DRAFT_LAYERS:]:
            layer.self_attn.o_proj.weight.mul_(0.05)     # later layers: small residual updates
            layer.mlp.down_proj.weight.mul_(0.05)
        target.lm_head.weight.mul_(8.0)                   # sharp next-token distributions
    draft_cfg = tf.LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": DRAFT_LAYERS})
    with torch.device(device):
        draft = tf.AutoModelForCausalLM.from_config(draft_cfg, dtype=dtype).eval()
    draft.load_state_dict({k: v for k, v in target.state_dict().items()
                           if not k.startswith("model.layers.")
                           or int(k.split(".")[2]) < DRAFT_LAYERS})
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = folder / name
        model.save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(DEMO_DIR / "target" / f, path / f)
        n = sum(p.numel() for p in model.parameters())
        say(f"{name}: {n / 1e6:.0f}M parameters, {dtype}, saved to {path}")
        RESULTS[f"{name}_params_m"] = round(n / 1e6, 1)
        paths.append(path)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return paths[0], paths[1]


def prompts_for(n: int) -> list[str]:
    from specflow.experiments.workloads import read_prompt_file
    from specflow.backends.hf.backend import DEMO_DIR

    prompts = read_prompt_file(str(DEMO_DIR / "prompts.jsonl"), "prompt")
    return (prompts * (1 + n // len(prompts)))[:n]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@section("batch 1: HF generate, HF assisted, specflow none/draft/ngram")
def batch_one(paths, prompts, args, device, dtype, pipes):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(paths[0], dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(paths[1], dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(paths[0])
    N = args.new_tokens

    def hf(**kw):
        def run(prompt):
            ids = tok(prompt, return_tensors="pt").input_ids.to(device)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                  min_new_tokens=N, do_sample=False, pad_token_id=0, **kw)
            return out[0, ids.shape[1]:].tolist()
        return run

    def sf(name):
        def run(prompt):
            return pipes[name].generate([prompt], max_new_tokens=N, max_batch_size=1)[0].token_ids
        return run

    arms = {"HF generate": hf(), "HF assisted": hf(assistant_model=draft),
            **{f"specflow {n}": sf(n) for n in pipes}}
    for fn in arms.values():                       # warm-up (kernels, allocator, cuBLAS handles)
        fn(prompts[0][:100])
    outs = {a: [] for a in arms}
    speed = {a: [] for a in arms}
    stats = {n: [] for n in pipes}
    for prompt in prompts:
        for arm, fn in arms.items():
            sync(device)
            start = time.perf_counter()
            out = fn(prompt)
            sync(device)
            speed[arm].append(len(out) / (time.perf_counter() - start))
            outs[arm].append(out)
            name = arm.removeprefix("specflow ")
            if name in pipes:
                stats[name].append(pipes[name].last_stats)
    ref_hf, ref_none = outs["HF generate"], outs["specflow none"]
    hf_speed = statistics.median(speed["HF generate"])
    rows = []
    for arm in arms:
        med = statistics.median(speed[arm])
        ref = ref_hf if arm in ("specflow none", "HF assisted") else ref_none
        row = {"arm": arm, "tokens_per_s": round(med, 1), "vs_hf_generate": round(med / hf_speed, 2),
               "compared_with": "HF generate" if ref is ref_hf else "specflow none",
               "exact_prompts": f"{sum(a == b for a, b in zip(outs[arm], ref))}/{len(ref)}",
               "common_prefix": round(statistics.mean(
                   common_prefix(a, b) / max(1, len(b)) for a, b in zip(outs[arm], ref)), 3)}
        name = arm.removeprefix("specflow ")
        if name in stats and stats[name]:
            acc = sum(s["num_accepted_tokens"] for s in stats[name])
            exam = sum(s["num_examined_draft_tokens"] for s in stats[name])
            passes = sum(s["num_target_passes"] for s in stats[name])
            committed = sum(s["num_committed_tokens"] for s in stats[name])
            row.update(alpha=round(acc / exam, 3) if exam else None,
                       tau=round(committed / passes, 2),
                       vs_specflow_none=round(med / statistics.median(speed["specflow none"]), 2))
        rows.append(row)
    RESULTS["batch1"] = rows
    table(rows)


@section("batch 8 and 32: HF batched generate, specflow none/draft/ngram")
def batched(paths, prompts, args, device, dtype, pipes):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(paths[0], dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(paths[0], padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    N = args.new_tokens
    rows = []
    for B in args.batches:
        if B == 1:
            continue
        batch = prompts_for(B)
        enc = tok(batch, return_tensors="pt", padding=True).to(device)
        target.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        sync(device)
        start = time.perf_counter()
        out = target.generate(**enc, max_new_tokens=N, min_new_tokens=N, do_sample=False,
                              pad_token_id=tok.pad_token_id)
        sync(device)
        hf_tps = B * N / (time.perf_counter() - start)
        del out
        rows.append({"arm": "HF generate (left-padded)", "batch": B, "tokens_per_s": round(hf_tps, 1),
                     "vs_hf_generate": 1.0})
        none_out = None
        for name, pipe in pipes.items():
            pipe.generate(batch[:2], max_new_tokens=4, max_batch_size=B)
            sync(device)
            start = time.perf_counter()
            res = pipe.generate(batch, max_new_tokens=N, max_batch_size=B)
            sync(device)
            secs = time.perf_counter() - start
            toks = [r.token_ids for r in res]
            none_out = toks if name == "none" else none_out
            s = pipe.last_stats
            row = {"arm": f"specflow {name}", "batch": B,
                   "tokens_per_s": round(sum(map(len, toks)) / secs, 1),
                   "vs_hf_generate": round(sum(map(len, toks)) / secs / hf_tps, 2),
                   "prefill_s": round(s["seconds"]["prefill"], 3)}
            if name != "none" and none_out is not None:
                row["exact_prompts_vs_none"] = f"{sum(a == b for a, b in zip(toks, none_out))}/{B}"
                row["alpha"] = round(s["alpha"], 3)
            rows.append(row)
    RESULTS["batched"] = rows
    table(rows)


@section("pass cost on this device (bench/passcost.py)")
def pass_cost(paths, args, device, dtype):
    import passcost

    batches = [b for b in (1, 8, 32) if b in args.batches] or [1]
    rows, memory, bandwidth, how = passcost.measure(
        {"target": paths[0], "draft": paths[1]}, str(dtype).split(".")[1], "auto", device,
        [1, 2, 3, 5, 9], [64, 512, 1000], batches, 10, 4096 if device.type == "cuda" else 256)
    env = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": str(dtype),
           "bandwidth_gbs": bandwidth / 1e9, "bandwidth_read": how, "repeats": 10}
    RESULTS["passcost"] = {"env": env, "passes": rows, "memory": memory}
    say(passcost.render(env, rows, memory))
    if args.out:
        passcost.plot(rows, pathlib.Path(args.out) / "gpu_passcost.png", f"pass cost, {env['device']}, "
                      f"{dtype} (dashed: weight-read bound)")


@section("graph pass cost: one target pass, CUDA graphs on and off, contexts 64 to 1000")
def graph_pass_cost(paths, args, device, dtype):
    """A 1- and a 5-position target pass at contexts 64, 512 and 1000 (batch 1), as the round
    runs it (plan, pass, lengths rolled back), with model.graphs on and off: the targets are a
    one-position pass within 2x its weight-read bound, flat from context 64 to 1000, and 5
    positions within 1.1x of one."""
    from specflow import Pipeline

    rows = []
    for graphs in (False, True):
        base = ["model=hf", f"model.path={paths[0]}", "draft=none", "proposer=none",
                f"device={args.device}", f"dtype={args.dtype}", "show_progress=false",
                "max_batch_size=1", f"model.graphs={str(graphs).lower()}", "pack=false"]
        target = Pipeline.from_config(base).target
        target.tune(rows=1, positions=args.k + 1)
        slot = torch.tensor([0])
        for ctx in (64, 512, 1000):
            target.reset(0)
            target.forward(slot, torch.arange(ctx, device="cpu")[None] % 1000 + 5,
                           torch.tensor([ctx]), logits=False)
            for T in (1, args.k + 1):
                ids = torch.full((1, T), 7)

                def one(ids=ids, T=T, ctx=ctx, target=target, slot=slot):
                    target.forward(slot, ids, torch.tensor([T]))
                    target.cache.truncate([0], [ctx])

                for _ in range(3):
                    one()
                sync(device)
                start = time.perf_counter()
                for _ in range(20):
                    one()
                sync(device)
                ms = (time.perf_counter() - start) / 20 * 1e3
                rows.append({"graphs": graphs, "context": ctx, "positions": T, "ms": round(ms, 3)})
        if graphs:
            say(f"graphs: {target.describe().get('graphs')}")
        del target
    RESULTS["graph_pass_cost"] = rows
    table(rows)


@section("profile: a target pass at short and long context, and host syncs per round")
def profile(paths, args, device, dtype):
    """Where a pass's time goes (torch.profiler, top ops by host and by device time) and how
    many synchronizing CUDA calls a round makes (torch.cuda.set_sync_debug_mode)."""
    import warnings

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from specflow import Pipeline
    from specflow.backends.hf.backend import HFBackend, HFModelConfig

    name = str(dtype).split(".")[1]
    for forward in ("lean", "hf"):
        backend = HFBackend(HFModelConfig(path=str(paths[0]), dtype=name, forward=forward), device, 1)
        slot = torch.tensor([0])
        backend.forward(slot, torch.randint(1, 8000, (1, 1000)), torch.tensor([1000]), logits=False)

        def one(ctx, T=1, backend=backend, slot=slot):
            backend.truncate(slot, [ctx])
            backend.forward(slot, torch.randint(1, 8000, (1, T)), torch.tensor([T]))

        for ctx in (64, 512):
            for _ in range(3):
                one(ctx)
            sync(device)
            start = time.perf_counter()
            for _ in range(10):
                one(ctx)
            sync(device)
            say(f"{forward} forward, context {ctx}, 1 position: "
                f"{(time.perf_counter() - start) / 10 * 1e3:.2f} ms a pass")
        if forward == "lean":
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            for ctx in (64, 512):
                with torch_profile(activities=acts) as prof:
                    for _ in range(5):
                        one(ctx)
                    sync(device)
                key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
                say(f"-- lean, context {ctx}: top ops by device time (5 passes)")
                say(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=48))
                say(f"-- lean, context {ctx}: top ops by host time (5 passes)")
                say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8,
                                              max_name_column_width=48))
    if device.type != "cuda":
        return
    base = ["model=hf", f"model.path={paths[0]}", "draft=hf", f"draft.path={paths[1]}",
            "device=cuda", f"dtype={name}", "show_progress=false"]
    prompt = prompts_for(1)[0]
    for proposer in ("none", "draft"):
        pipe = Pipeline.from_config([*base, f"proposer={proposer}"])
        pipe.generate([prompt], max_new_tokens=8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pipe.generate([prompt], max_new_tokens=32)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        rounds = pipe.last_stats["num_target_passes"]
        sites = {}
        for w in caught:
            if "synchroniz" in str(w.message):
                where = f"{pathlib.Path(w.filename).name}:{w.lineno}"
                sites[where] = sites.get(where, 0) + 1
        say(f"proposer={proposer}: {sum(sites.values())} synchronizing calls in {rounds} rounds "
            f"(+ admission and prefill): {sites}")
        say(f"  stage seconds: { {k: round(v, 3) for k, v in pipe.last_stats['seconds'].items()} }")


@section("float32 exactness: greedy speculative == greedy plain, batch 1 and 8")
def exactness(paths, args, device):
    """The same pair in float32 (where a position's logits do not depend on the pass width up to
    ~1e-6): draft and ngram must reproduce plain decoding token for token, ragged prompts."""
    from specflow import Pipeline

    base = ["model=hf", f"model.path={paths[0]}", "draft=hf", f"draft.path={paths[1]}",
            f"device={args.device}", "dtype=float32", "show_progress=false", "max_batch_size=8"]
    prompts = [p[: 40 + 37 * i] for i, p in enumerate(prompts_for(8))]      # ragged lengths
    plain = Pipeline.from_config([*base, "proposer=none"])
    rows = []
    for B in (1, 8):
        ref = [r.token_ids for r in plain.generate(prompts, max_new_tokens=48, max_batch_size=B)]
        for name in ("draft", "ngram"):
            pipe = Pipeline.from_config([*base, f"proposer={name}", f"proposer.k={args.k}"])
            got = [r.token_ids for r in pipe.generate(prompts, max_new_tokens=48, max_batch_size=B)]
            rows.append({"proposer": name, "batch": B,
                         "equal_prompts": f"{sum(a == b for a, b in zip(got, ref))}/{len(ref)}",
                         "alpha": round(pipe.last_stats["alpha"], 3)})
            del pipe
    RESULTS["float32_exactness"] = rows
    table(rows)


def table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    say(" | ".join(keys))
    for r in rows:
        say(" | ".join(str(r.get(k, "")) for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="tiny models (a CPU smoke test)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="")
    ap.add_argument("--skip", default="", help="steps to skip: batch1,batched,passcost,"
                    "exactness,profile,graphpass")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens, batches 1 and "
                    "8, no profile: under 8 minutes with start-up")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false",
                    help="leave out the CUDA-graph arms (model.graphs=true)")
    ap.add_argument("--only", default="", help="'profile': the profile step alone")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.batches = 4, 64, "1,8"
        args.skip = ",".join(filter(None, [args.skip, "profile"]))
    if args.only:
        args.skip = "batch1,batched,passcost,pipelines,exactness,graphpass"
    args.batches = [int(b) for b in args.batches.split(",")]
    skip = set(args.skip.split(",")) - {""}
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    import transformers

    RESULTS["env"] = {"torch": torch.__version__, "transformers": transformers.__version__,
                      "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "dtype": args.dtype, "new_tokens": args.new_tokens, "k": args.k}
    say(json.dumps(RESULTS["env"]))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_pair(pathlib.Path(tmp), TINY if args.tiny else FULL, device, dtype)
        if paths is None:
            sys.exit(1)
        if "profile" in args.only:
            profile(paths, args, device, dtype)
        from specflow import Pipeline

        @section("specflow pipelines")
        def pipelines():
            base = ["model=hf", f"model.path={paths[0]}", "draft=hf", f"draft.path={paths[1]}",
                    f"device={args.device}", f"dtype={args.dtype}", "show_progress=false",
                    f"max_batch_size={max(args.batches)}"]
            pipes = {"none": Pipeline.from_config([*base, "proposer=none"])}
            for name in ("draft", "ngram"):
                pipes[name] = Pipeline.from_config([*base, f"proposer={name}", f"proposer.k={args.k}"])
            # token trees (docs/trees.md): where a pass is bound by the weight read, 17 positions
            # should cost about what 5 do, and the tree's longer accepted paths should pay
            pipes["draft tree"] = Pipeline.from_config(
                [*base, "proposer=draft", f"proposer.k={args.k}", "proposer.topk=4",
                 "proposer.num_draft_tokens=16"])
            if args.graphs:      # the target's chain passes and the draft's steps as CUDA graphs
                graphs = ["model.graphs=true", "draft.graphs=true"]
                pipes["none graphs"] = Pipeline.from_config([*base, *graphs, "proposer=none"])
                pipes["draft graphs"] = Pipeline.from_config(
                    [*base, *graphs, "proposer=draft", f"proposer.k={args.k}"])
            how = pipes["none"].target.describe()
            say(f"target forward: {'lean, ' + how['kernels'] if how['forward'] == 'lean' else 'transformers'}")
            return pipes

        pipes = pipelines() if "pipelines" not in skip else None
        if pipes:
            prompts = prompts_for(args.prompts)
            if "batch1" not in skip:
                batch_one(paths, prompts, args, device, dtype, pipes)
            if "batched" not in skip:
                batched(paths, prompts, args, device, dtype, pipes)
            del pipes
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if "passcost" not in skip:
            pass_cost(paths, args, device, dtype)
        if "graphpass" not in skip and args.graphs:
            graph_pass_cost(paths, args, device, dtype)
        if "exactness" not in skip:
            exactness(paths, args, device)
        if "profile" not in skip and "profile" not in args.only:
            profile(paths, args, device, dtype)
    RESULTS["seconds"] = round(time.perf_counter() - started, 1)
    say(f"\ntotal {RESULTS['seconds']} s; failed steps: {RESULTS.get('failed', 'none')}")
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
