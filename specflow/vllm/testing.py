"""A stand-in for vLLM's side of the custom_class contract: test a proposer plugin inside "vLLM"
without installing vLLM.

`FakeEngine` keeps requests in rows as vLLM's persistent batch does (`token_ids_cpu`,
`num_tokens_no_spec`), verifies drafts greedily against a toy target, and calls the drafter after
every step with what each row committed, as vLLM's model runner does. Tests move rows, skip
steps and add or remove requests between calls:

    from specflow.vllm import SpecflowProposer
    from specflow.vllm.testing import FakeEngine, vllm_config

    drafter = SpecflowProposer(vllm_config(k=4), overrides=["proposer=mine"])
    engine = FakeEngine(drafter, max_num_seqs=4)
    engine.add("a", [1, 2, 3, 1, 2])
    drafts = engine.step()          # each row's drafts; engine.accepted counts what verified
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def vllm_config(k: int = 4, max_num_seqs: int = 4, max_model_len: int = 256):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k, method="custom_class",
                                           model="specflow.vllm.SpecflowProposer"),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs))


def toy_next(tokens: list[int]) -> int:
    """A deterministic target with repetitive output (n-gram drafts get accepted)."""
    return (tokens[-1] * 7 + (tokens[-2] if len(tokens) > 1 else 0)) % 13 + 1


class FakeEngine:
    def __init__(self, drafter, max_num_seqs: int, max_model_len: int = 256):
        self.drafter = drafter
        self.token_ids_cpu = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.rows: list[dict] = []          # row -> {"id", "tokens", "drafts", "prefilled"}
        self.accepted = self.drafted = 0

    def add(self, rid, prompt: list[int]) -> None:
        self.rows.append({"id": rid, "tokens": list(prompt), "drafts": [], "prefilled": False})

    def remove(self, rid) -> dict:
        i = next(i for i, r in enumerate(self.rows) if r["id"] == rid)
        return self.rows.pop(i)

    def swap(self, a: int, b: int) -> None:
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    def step(self, skip: frozenset = frozenset()) -> list[list[int]]:
        """One step: every row (but those in `skip`) verifies its drafts and commits tokens."""
        sampled = []
        for r in self.rows:
            if r["id"] in skip:
                sampled.append([])
                continue
            if not r["prefilled"]:
                r["prefilled"] = True
                new = [toy_next(r["tokens"])]
            else:
                new = []
                for d in r["drafts"]:
                    t = toy_next(r["tokens"] + new)
                    new.append(t)
                    if t != d:
                        break
                    self.accepted += 1
                else:
                    new.append(toy_next(r["tokens"] + new))
                self.drafted += len(r["drafts"])
            r["tokens"] += new
            sampled.append(new)
        for i, r in enumerate(self.rows):
            self.num_tokens[i] = len(r["tokens"])
            self.token_ids_cpu[i, :len(r["tokens"])] = r["tokens"]
        drafts = self.drafter.propose(sampled, self.num_tokens, self.token_ids_cpu)
        assert len(drafts) == len(self.rows)
        for r, d, s in zip(self.rows, drafts, sampled):
            r["drafts"] = list(d) if s else r["drafts"]
        return drafts
