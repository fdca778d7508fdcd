"""Host syncs per round: one (the verifier's decision; drafts a proposer made on the device and
counted stay there), two where a proposer's drafts must be read to be counted (a token tree:
its layout), counted by a probe.

On a GPU every read of a device tensor by the host (`.tolist()`, `.item()`, `.cpu()`, `bool(t)`,
and the ops whose output size depends on the data: `nonzero`, `masked_select`, `unique`, boolean
indexing) stalls the host until the device has caught up, so launch overhead stops overlapping
with the device's work. These tests run on a CPU, where nothing stalls, so the probe tracks which
tensors *would* live on the device: every tensor created with an explicit `device=` or moved with
`.to(device)`, every model output, and everything computed from them (a TorchFunctionMode taints
the outputs of any op with a tainted input, and the target of an in-place write of one). Tensors
built on the host from Python data stay clean, and reading them costs nothing anywhere.
"""
from __future__ import annotations

import traceback
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode

from specflow import Pipeline

READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "argwhere", "masked_select", "unique", "equal", "allclose", "is_nonzero"}
INPLACE_EXTRA = {"__setitem__", "index_put_", "scatter_", "masked_fill_", "copy_"}


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _caller() -> tuple[str, str]:
    """(folder/file:line, source line) of the innermost frame outside torch and this probe."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != __file__ and "/torch/" not in frame.filename:
            where = "/".join(frame.filename.rsplit("/", 2)[-2:])
            return f"{where}:{frame.lineno}", frame.line or ""
    return "?", ""


class HostReadProbe(TorchFunctionMode):
    """Counts host reads of (would-be) device tensors while `active`, with their call sites."""

    def __init__(self):
        super().__init__()
        self.tainted: dict[int, weakref.ref] = {}     # id -> ref (tensors compare elementwise)
        self.active = False
        self.reads: list[str] = []

    def taint(self, obj):
        for t in _tensors(obj):
            self.tainted[id(t)] = weakref.ref(t)
        return obj

    def has(self, t: torch.Tensor) -> bool:
        ref = self.tainted.get(id(t))
        return ref is not None and ref() is t

    def _is_tainted(self, args, kwargs) -> bool:
        return any(self.has(t) for t in _tensors((args, kwargs)))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        dirty = self._is_tainted(args, kwargs)
        bool_index = name in ("__getitem__", "__setitem__") and len(args) > 1 and any(
            t.dtype == torch.bool and self.has(t) for t in _tensors(args[1]))
        if self.active and ((dirty and name in READS) or bool_index):
            site, line = _caller()
            if "cpu only" not in line:         # a read the code takes only on a CPU device
                self.reads.append(f"{name} at {site}")
        out = func(*args, **kwargs)
        device_born = kwargs.get("device") is not None or (name == "to" and (
            "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args[1:])))
        if (name == "cpu" or (name == "to" and device_born)) and out is args[0]:
            out = out.clone()                  # on a GPU .cpu() makes a new, host tensor, and
                                               # .to(device) a device one: the host one stays clean
        if (dirty or device_born) and name not in READS:
            self.taint(out)
            if args and isinstance(args[0], torch.Tensor) and (
                    name.endswith("_") or name in INPLACE_EXTRA):
                self.taint(args[0])
        return out


def reads_per_round(overrides, prompts, max_new_tokens=12, max_batch_size=3, plugins=()):
    """Host reads of would-be device tensors in each round of one generate() call."""
    pipe = Pipeline.from_config(["model=demo", "draft=demo", "show_progress=false", *overrides])
    pipe.copy_outputs_to_host = True      # the round's one copy, as on a device
    for plugin in plugins:
        pipe.register(plugin)
    probe = HostReadProbe()
    for backend in filter(None, (pipe.target, pipe.draft)):     # model outputs live on the device
        forward = backend.forward
        backend.forward = lambda *a, _f=forward, **kw: probe.taint(_f(*a, **kw))
    rounds: list[list[str]] = []
    one_round = pipe.step

    def counted(batch, index):
        probe.active, probe.reads = True, []
        try:
            return one_round(batch, index)
        finally:
            probe.active = False
            rounds.append(probe.reads)

    pipe.step = counted
    with probe:
        results = pipe.generate(prompts, max_new_tokens=max_new_tokens,
                                max_batch_size=max_batch_size)
    return rounds, results


PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "class Stack:\n    def push(self"]


@pytest.mark.parametrize("overrides,limit", [
    (["proposer=none"], 1),                       # no drafts: only the verifier's output
    (["proposer=ngram"], 1),                      # drafts made on the host
    (["proposer=draft"], 1),                      # counted drafts: scored where they are
    (["proposer=eagle"], 1),                      # the head reads the target's states on device
    (["proposer=draft", "logits=[temperature,top_p]"], 1),
    (["proposer=eagle", "logits=[temperature]"], 1),
    (["proposer=ngram", "logits=[repetition_penalty,temperature]"], 1),
    (["proposer=draft", "logits=[repetition_penalty,temperature]"], 1),
    # a token tree is built on the device and read once, finished (its layout is host data)
    (["proposer=eagle", "proposer.topk=3", "proposer.k=4", "proposer.num_draft_tokens=10"], 2),
    (["proposer=draft", "proposer.topk=3", "proposer.k=4", "proposer.num_draft_tokens=10",
      "logits=[repetition_penalty,temperature]"], 2),
    # a grammar walks each draft step's new token on the host: one read per draft step more,
    # and one of the drafts for the target's positions
    (["proposer=draft", "proposer.k=4", "constraint=choice",
      "constraint.choices=[alpha,beta,gamma]"], 2 + 4),
    # so do processors that look at the prefix; they share that one read
    (["proposer=draft", "proposer.k=4", "logits=[no_repeat_ngram,min_new_tokens,bad_words]",
      "logits.bad_words.words=[foo bar]"], 2 + 4),
])
def test_a_round_reads_the_device_once_unless_a_stage_walks_drafts_on_the_host(overrides, limit):
    rounds, results = reads_per_round(overrides, PROMPTS)
    assert rounds and all(r.token_ids for r in results)
    worst = max(rounds, key=len)
    assert len(worst) <= limit, f"{len(worst)} host reads in one round: {worst}"


def test_the_probe_sees_a_read_of_a_device_tensor():
    # the probe must fail a stage that reads the device (else the test above proves nothing)
    from specflow import hookimpl

    class Peeker:
        @hookimpl
        def specflow_process_logits(self, shaping):
            if shaping.source == "target":
                float(shaping.logits.max())          # a host read of the target's logits

    rounds, _ = reads_per_round(["proposer=none"], PROMPTS[:1], max_new_tokens=4,
                                max_batch_size=1, plugins=[Peeker()])
    assert max(len(r) for r in rounds) >= 2
    assert any("__float__" in site for r in rounds for site in r)
