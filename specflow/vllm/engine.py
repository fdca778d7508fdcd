"""`engine=vllm`: a run (or an A/B arm) decoded by an installed vLLM instead of specflow.

The arm's config says what to run, as it does for specflow: the same model, prompts, chat
template, max_new_tokens and max_batch_size; the proposer becomes vLLM's own method, or
specflow's drafter inside vLLM (vllm/arm.py maps and checks them). Records have the
shape specflow writes (requests.jsonl, metrics.json), so `specflow report` puts both engines side
by side. The prompts go to vLLM in one call, max_batch_size at a time; each request's counts
are vLLM's own per-request speculative metrics (every verify step's drafted and accepted
tokens), its seconds its life in the engine (first scheduled to last token), as specflow counts
a request's rounds; the aggregate's seconds are the call's wall time.
"""
from __future__ import annotations

import os
import pathlib
import time
import uuid
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from specflow.errors import ConfigError
from specflow.vllm.arm import brief, check_arm, import_vllm, speculative_config
from specflow.vllm.stages import OVERRIDES_ENV


def request_counters(spec, committed: int, seconds: float, no_draft: str):
    """A request's Counters from vLLM's per-request speculative metrics (`spec`: its
    spec_decode_metrics at level "detailed", None for plain decoding): each verify step drafted
    d tokens and accepted a of them; every other pass (the prefill's first token, steps without
    drafts) gave one token of its own. no_draft: why a pass ran without drafts."""
    from specflow.metrics import Counters

    c = Counters()
    steps = list(zip(spec.per_step_accepted, spec.per_step_drafted)) if spec is not None else []
    left = committed
    for accepted, drafted in steps:
        got = min(accepted + 1, left)
        c.add_row(int(drafted), min(int(accepted), got), got)
        left -= got
    for _ in range(max(left, 0)):
        c.add_row(0, 0, 1, no_draft)
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
            os.environ[OVERRIDES_ENV] = overrides
        from transformers import AutoTokenizer
        from vllm import LLM

        from specflow.backends.hf.backend import HFTokenizer

        self.session = uuid.uuid4().hex[:12]
        tok = AutoTokenizer.from_pretrained(self.args["model"], local_files_only=True)
        eos = tok.eos_token_id
        self.tokenizer = HFTokenizer(tok, frozenset([] if eos is None else [eos]))
        try:
            self.llm = LLM(**self.args)
        except Exception as exc:      # vLLM's own checks (pydantic, ValueError, ...): one line
            import traceback

            traceback.print_exc()                          # the whole story, into vllm.log
            said = " ".join(str(exc).split())[:300] or type(exc).__name__
            raise ConfigError(f"vLLM refused this arm ({type(exc).__name__}: {said}); change "
                              f"the setting it names (the arm's engine arguments: "
                              f"{brief(self.args)}); vllm.log in the run folder has vLLM's "
                              f"whole message") from None

    def describe(self) -> dict:
        import vllm

        return {"engine": "vllm", "vllm_version": vllm.__version__,
                "speculative_config": self.args["speculative_config"],
                "overrides": os.environ.get(OVERRIDES_ENV)
                if self.cfg.vllm.drafter == "specflow" else None}

    def _params(self, max_tokens: int):
        from vllm import SamplingParams

        stop = self.cfg.stop
        return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                              stop=list(stop.get("strings") or []) or None,
                              stop_token_ids=list(stop.get("token_ids") or []) or None,
                              ignore_eos=not bool(stop.get("eos", True)),
                              include_stop_str_in_output=bool(stop.get("include_stop_str")))

    def warm_up(self, rows: int) -> int:
        """Untimed, before the first timed call: WARMUP_TOKENS of the warm-up prompt in `rows`
        rows (specflow/app/warmup.py), then vLLM's prefix cache emptied, so the timed requests
        find warm passes but none of the warm-up's cached blocks. -> the requests it ran."""
        from vllm.inputs import TokensPrompt

        from specflow.experiments.workloads import chat_mode
        from specflow.app.warmup import WARMUP_TOKENS, warmup_prompts

        limit = self.cfg.model.get("max_model_len")
        prompts = warmup_prompts(self.tokenizer, chat_mode(self.cfg),
                                 min(rows, int(self.cfg.max_batch_size)),
                                 int(limit) if limit else None)
        if prompts:
            self.llm.generate([TokensPrompt(prompt_token_ids=self.tokenizer.encode(p))
                               for p in prompts], self._params(WARMUP_TOKENS), use_tqdm=False)
            reset = getattr(self.llm, "reset_prefix_cache", None)
            if callable(reset):
                reset()
        return len(prompts)

    def generate(self, todo: list[tuple[int, str]], on_result: Callable[[dict], None],
                 warm_up: bool = False) -> float:
        """Decode (index, prompt) pairs in one call (max_batch_size at a time, as vLLM
        schedules them); on_result gets each request's record. -> the call's wall seconds.
        warm_up: the untimed warm-up runs first (self.warm_up).

        A request's seconds are its life in the engine, from first scheduled to last token (as
        specflow counts a request's rounds); its counts are vLLM's own for it, step by step."""
        from vllm.inputs import TokensPrompt

        cfg = self.cfg
        if not todo:
            return 0.0
        if warm_up:
            self.warm_up(len(todo))
        params = self._params(int(cfg.max_new_tokens))
        prompts = [TokensPrompt(prompt_token_ids=self.tokenizer.encode(p)) for _, p in todo]
        no_draft = "policy" if self.args["speculative_config"] else f"proposer={cfg.proposer.name}"
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        for (index, prompt), out in zip(todo, outs):
            completion = out.outputs[0]
            ids, reason = self._returned(completion)
            m = out.metrics
            seconds = m.last_token_ts - m.scheduled_ts if m is not None and m.last_token_ts \
                else wall / len(todo)
            counts = request_counters(completion.spec_decode_metrics, len(ids), seconds, no_draft)
            on_result({"index": index, "prompt": prompt, "text": completion.text,
                       "token_ids": ids, "finish_reason": reason, "stats": counts.as_dict(),
                       "session": self.session, "session_seconds": {"engine": wall}})
        return wall

    def _returned(self, completion) -> tuple[list[int], str]:
        """specflow's shape of a completion: no EOS token at the end; eos / stop / length."""
        ids = list(completion.token_ids)
        reason = completion.finish_reason or "length"
        if reason == "stop" and completion.stop_reason is None:
            if ids and ids[-1] in self.tokenizer.eos_token_ids:
                ids = ids[:-1]
            reason = "eos"
        return ids, reason



def run_on_vllm(cfg: DictConfig, out: pathlib.Path, *, prompts: int, rerun: str, on_start=None,
                write_config: bool = False, metrics_extra: dict | None = None,
                warm_up: bool = False):
    """`run_into` for engine=vllm -> (records in prompt order, aggregate, resumed, config).
    warm_up: the engine's untimed warm-up before the first timed request (VllmRunner.warm_up).

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
            "warm_up": warm_up, "error": str(error)}), encoding="utf-8")
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
              metrics_extra: dict, warm_up: bool = False) -> None:
    """The child's side: one engine, the missing requests, then metrics.json."""
    from specflow.app.prompts import read_prompts
    from specflow.experiments.workloads import apply_chat_template, chat_mode
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

        runner.generate(todo, record, warm_up=warm_up)
    ordered = [rows[i] for i in range(len(prompts))]
    total = Counters()      # the counts of every request; the wall time of the calls that ran them
    calls: dict[str, float] = {}
    for row in ordered:
        total.add_counts(Counters.from_dict(row["stats"]))
        calls[str(row.get("session"))] = float(row.get("session_seconds", {}).get("engine", 0.0))
    total.seconds = {"engine": sum(calls.values())}
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
                  job["rerun"], job["write_config"], job["metrics_extra"], job.get("warm_up", False))
    except SpecflowError as exc:
        pathlib.Path(job["error"]).write_text(str(exc), encoding="utf-8")
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
