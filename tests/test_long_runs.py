"""Long runs keep memory flat: one 20,000-token sequence, and 2,000 requests in one A/B arm.

RSS (resident memory of this process) is sampled by an observer as the run goes; after warm-up it
may not keep growing. Synthetic pair: no context limit, so the length comes from the pipeline's
own bookkeeping (token lists, metrics, stop trimming, caches), which is what these tests watch.
"""
from __future__ import annotations

import json

import pytest

from specflow import hookimpl
from specflow.resume import run_resumable

MB = 1024 * 1024


def rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")   # pragma: no cover


class RssProbe:
    """RSS every `every` rounds and at every finished request."""

    def __init__(self, every: int = 200):
        self.every, self.rounds, self.samples = every, 0, []

    @hookimpl
    def specflow_round_end(self, result, pipeline):
        self.rounds += 1
        if self.rounds % self.every == 0:
            self.samples.append(rss())

    @hookimpl
    def specflow_request_end(self, slot, request, finish_reason):
        self.samples.append(rss())


@pytest.mark.slow
def test_one_sequence_of_20000_tokens_keeps_memory_flat(make_pipeline):
    probe = RssProbe(every=100)
    pipe = make_pipeline("proposer=draft", "logits=[temperature]", "stop.strings=['never-ever']",
                         plugins=[probe])
    out = pipe.generate(["a long one"], max_new_tokens=20_000)[0]
    assert len(out.token_ids) == 20_000 and out.finish_reason == "length"
    warm = probe.samples[len(probe.samples) // 10]       # after the first 2,000 tokens
    growth = max(probe.samples) - warm
    assert growth < 40 * MB, f"RSS grew {growth / MB:.1f} MB after warm-up"


@pytest.mark.slow
def test_2000_requests_in_one_ab_arm_keep_memory_flat(make_pipeline, tmp_path):
    probe = RssProbe(every=10**9)
    pipe = make_pipeline("proposer=draft", "max_new_tokens=12", "max_batch_size=8",
                         plugins=[probe])
    prompts = [f"request {i}: " + "xy" * (i % 7) for i in range(2000)]
    rows, stats, resumed = run_resumable(pipe, prompts, tmp_path, progress=False)
    assert len(rows) == 2000 and resumed == 0
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 2000
    assert stats["num_committed_tokens"] == sum(len(r["token_ids"]) for r in rows)
    s = probe.samples
    warm, mid, end = s[200], s[1000], s[-1]
    # the per-request records (kept for metrics.json) are the only thing allowed to grow
    assert end - warm < 40 * MB, f"RSS grew {(end - warm) / MB:.1f} MB over 1,800 requests"
    assert (end - mid) < 2 * max(mid - warm, 8 * MB), "memory growth speeds up"
    json.dumps(stats)


@pytest.mark.slow
def test_20000_tokens_through_the_demo_pair_keep_memory_flat():
    # the real backends: lean forward, per-slot KV caches, batched prefill of each admission
    from specflow import Pipeline

    probe = RssProbe(every=40)
    pipe = Pipeline.from_config(["model=demo", "draft=demo", "proposer=draft", "max_batch_size=4",
                                 "show_progress=false", "stop.eos=false"], plugins=[probe])
    prompts = [f"def f{i}(x):\n    " + "y = x + 1\n    " * (i % 5) for i in range(100)]
    out = pipe.generate(prompts, max_new_tokens=200)
    assert sum(len(r.token_ids) for r in out) == 20_000
    warm = probe.samples[len(probe.samples) // 10]
    growth = max(probe.samples) - warm
    assert growth < 40 * MB, f"RSS grew {growth / MB:.1f} MB after warm-up"
