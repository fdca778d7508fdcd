"""Rows no token survives: an error that names its cause where the round reached them, nothing
where it did not (speculation must not change outcomes, errors included)."""
from __future__ import annotations

import pytest
import torch

from specflow import Pipeline, SpecflowError, hookimpl
from specflow.stages.empty_rows import EmptyDistributionError, EmptyRowLog, ShapeCall, mark_empty
from specflow.state import PAD, Proposal

INF = float("inf")


def test_mark_empty_finds_all_minus_inf_nan_and_plus_inf_rows():
    logits = torch.zeros(2, 3, 4)
    logits[0, 0] = -INF                  # empty
    logits[0, 1, 2] = float("nan")       # broken
    logits[1, 2, 0] = INF                # broken
    logits[1, 0, :3] = -INF              # one token left: fine
    shaped, unusable = mark_empty(logits)
    assert unusable.tolist() == [[True, True, False], [False, False, True]]
    assert not shaped.isnan().any() and not (shaped == INF).any() and shaped[1, 0, 3] == 0
    assert shaped[1, 0, :3].eq(-INF).all()          # usable rows are untouched


def _call(source, rids, first, unusable):
    u = torch.tensor(unusable)
    return ShapeCall(source, rids, [[1, 2]] * len(rids), torch.full((len(rids), 4), PAD), first,
                     u, None)


def test_only_positions_plain_decoding_samples_from_count():
    log = EmptyRowLog()
    # target positions 0..3 of rows 7 and 8; row 7 has position 2 empty. consumed = positions
    # sampled from: accepted drafts + 1, cut after an EOS or stop
    log.add(_call("target", [7, 8], 0, [[False, False, True, False], [False] * 4]))
    assert log.first_counted([7, 8], [2, 4]) is None       # draft 2 rejected, or a stop at 1
    call, row, pos = log.first_counted([7, 8], [3, 1])    # reached
    assert (call.source, row, pos) == ("target", 0, 2)
    # a call whose first draft index is 1, row 8 only: its position 0 sits at depth 1
    log.clear()
    log.add(_call("target", [8], 1, [[True]]))
    assert log.first_counted([7, 8], [4, 1]) is None
    assert log.first_counted([7, 8], [1, 2])[1:] == (0, 0)


CHOICE = ["constraint=choice", "constraint.choices=[yes,no]"]


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_a_grammar_and_min_new_tokens_that_conflict_name_both(proposer):
    pipe = Pipeline.from_config([f"proposer={proposer}", *CHOICE, "logits=[min_new_tokens]",
                                 "logits.min_new_tokens.min_tokens=6"])
    with pytest.raises(EmptyDistributionError) as info:
        pipe.generate(["def f(x):\n    # answer: "], max_new_tokens=12)
    msg = str(info.value)
    assert "request 0, output token" in msg and "\n" not in msg, msg
    assert "constraint.choice allows only 1 token(s) here" in msg, msg
    assert "logits.min_new_tokens forbids all of them" in msg, msg
    assert info.value.exit_code == 2


class NanTarget:
    """The target 'overflows': NaN logits for request 1 from its third round on."""

    def __init__(self):
        self.rounds = 0

    @hookimpl(wrapper=True)
    def specflow_score(self, batch, proposal):
        logits = yield
        self.rounds += 1
        if self.rounds >= 3 and 1 in batch.request_ids:
            logits = logits.clone()
            logits[batch.request_ids.index(1), :, 5] = float("nan")
        return logits


@pytest.mark.parametrize("proposer", ["none", "draft"])
def test_nan_target_logits_are_an_error_naming_the_model(proposer):
    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic", f"proposer={proposer}"],
                                plugins=[NanTarget()])
    with pytest.raises(SpecflowError) as info:
        pipe.generate(["ab", "cd"], max_new_tokens=20)
    assert "request 1, output token" in str(info.value)
    assert "the target model's logits are NaN, infinite or all -inf" in str(info.value)


class NanProcessor:
    @hookimpl
    def specflow_process_logits(self, shaping):
        shaping.logits = shaping.logits * float("nan")


def test_a_processor_that_makes_nan_is_named():
    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic"])
    pipe.register(NanProcessor(), name="logits.broken")
    with pytest.raises(EmptyDistributionError, match="logits.broken turned the logits into NaN"):
        pipe.generate(["ab"], max_new_tokens=4)


BANNED = 30    # a token the processor below forbids, and after which it allows nothing


class BanAndDeadEnd:
    """Token 30 is never allowed, and a prefix ending in it allows no token at all. Plain decoding
    never reaches such a prefix; a proposer that drafts it makes the target shape one."""

    @hookimpl
    def specflow_process_logits(self, shaping):
        logits = shaping.logits.clone()
        logits[..., BANNED] = -INF
        for b in range(logits.shape[0]):
            for p in range(logits.shape[1]):
                if shaping.prefix(b, p)[-1] == BANNED:
                    logits[b, p] = -INF
        shaping.logits = logits


class ProposeBanned:
    @hookimpl
    def specflow_propose(self, batch, k):
        ks = k.clamp(max=2)                                                 # [B]
        ids = torch.full((batch.size, 2), BANNED, dtype=torch.long)
        return Proposal(torch.where(torch.arange(2)[None, :] < ks[:, None], ids, PAD))


@pytest.mark.parametrize("sampling", [False, True])
def test_unreached_empty_positions_raise_nothing_and_change_nothing(sampling):
    common = ["model=synthetic", "draft=synthetic"]
    if sampling:
        common += ["logits=[temperature]"]
    plain = Pipeline.from_config([*common, "proposer=none"])
    plain.register(BanAndDeadEnd(), name="logits.dead_end")
    expected = plain.generate(["ab", "cd"], max_new_tokens=12, seed=4)
    spec = Pipeline.from_config([*common, "proposer=ngram", "proposer.k=2"],
                                plugins=[ProposeBanned()])
    spec.register(BanAndDeadEnd(), name="logits.dead_end")
    got = spec.generate(["ab", "cd"], max_new_tokens=12, seed=4)
    assert spec.last_stats["num_draft_tokens"] > 0
    assert all(BANNED not in r.token_ids for r in got)
    if not sampling:
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]


FIRST = 31     # the only token allowed first; a stop token, after which nothing is allowed


class OnlyFirstThenNothing:
    """A request must start with token 31 (a stop token), and nothing may follow it. Plain
    decoding samples 31 and stops; it never shapes the position after it."""

    def __init__(self, prompt_len):
        self.prompt_len = prompt_len

    @hookimpl
    def specflow_process_logits(self, shaping):
        logits = shaping.logits.clone()
        for b in range(logits.shape[0]):
            for p in range(logits.shape[1]):
                prefix = shaping.prefix(b, p)
                if len(prefix) == self.prompt_len:
                    keep = logits[b, p, FIRST].clone()
                    logits[b, p] = -INF
                    logits[b, p, FIRST] = keep
                elif prefix[-1] == FIRST:
                    logits[b, p] = -INF
        shaping.logits = logits


class ProposeFirstTwice:
    @hookimpl
    def specflow_propose(self, batch, k):
        ks = k.clamp(max=2)
        ids = torch.full((batch.size, 2), FIRST, dtype=torch.long)
        return Proposal(torch.where(torch.arange(2)[None, :] < ks[:, None], ids, PAD))


def test_positions_after_an_accepted_stop_raise_nothing():
    common = ["model=synthetic", "draft=synthetic", f"stop.token_ids=[{FIRST}]"]
    plain = Pipeline.from_config([*common, "proposer=none"])
    plain.register(OnlyFirstThenNothing(2), name="logits.first")
    expected = plain.generate(["ab"], max_new_tokens=8)
    assert expected[0].finish_reason == "stop"
    spec = Pipeline.from_config([*common, "proposer=ngram", "proposer.k=2"],
                                plugins=[ProposeFirstTwice()])
    spec.register(OnlyFirstThenNothing(2), name="logits.first")
    got = spec.generate(["ab"], max_new_tokens=8)
    assert spec.last_stats["num_accepted_tokens"] == 1      # the stop token was a draft
    assert [(r.token_ids, r.finish_reason) for r in got] == \
        [(r.token_ids, r.finish_reason) for r in expected]


class NanOnTheDraftOnly:
    """Stands for a draft model whose logits overflow (a processor never branches on source)."""

    @hookimpl
    def specflow_process_logits(self, shaping):
        if shaping.source == "draft":
            shaping.logits = shaping.logits * float("nan")


def test_a_broken_draft_alone_is_no_error_and_changes_nothing():
    common = ["model=synthetic", "draft=synthetic"]
    expected = Pipeline.from_config([*common, "proposer=none"]).generate(["ab", "cd"],
                                                                         max_new_tokens=16)
    spec = Pipeline.from_config([*common, "proposer=draft"])
    spec.register(NanOnTheDraftOnly(), name="logits.draft_nan")
    got = spec.generate(["ab", "cd"], max_new_tokens=16)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert spec.last_stats["num_draft_tokens"] > 0


class NanInPlace:
    @hookimpl
    def specflow_process_logits(self, shaping):
        shaping.logits.mul_(float("nan"))


def test_a_stage_editing_logits_in_place_is_still_named():
    pipe = Pipeline.from_config(["model=synthetic", "draft=synthetic", "proposer=none"])
    pipe.register(NanInPlace(), name="logits.in_place")
    with pytest.raises(EmptyDistributionError, match="logits.in_place turned the logits into NaN"):
        pipe.generate(["ab"], max_new_tokens=4)
