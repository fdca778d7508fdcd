"""The synthetic pair: tables, the acceptance it is built to have, cache behaviour."""
from __future__ import annotations

import pytest
import torch

from specflow import ConfigError
from specflow.backends.synthetic import (CharTokenizer, SyntheticBackend, SyntheticDraftConfig,
                                       SyntheticModelConfig, acceptance_for_noise,
                                       base_distribution, noise_for_acceptance)


def test_acceptance_is_the_same_in_every_context():
    cfg = SyntheticModelConfig(contexts=32)
    p = SyntheticBackend(cfg).log_table.exp()
    q = SyntheticBackend(cfg, noise=0.4).log_table.exp()
    per_context = torch.minimum(p, q).sum(-1)                    # [C]
    assert torch.allclose(per_context, per_context[0].expand_as(per_context), atol=1e-5)
    base = base_distribution(cfg.vocab_size, cfg.concentration, cfg.seed)
    assert per_context[0].item() == pytest.approx(acceptance_for_noise(base, 0.4), abs=1e-5)


def test_noise_for_acceptance_inverts_acceptance_for_noise():
    base = base_distribution(64, 0.2, 0)
    for a in (0.5, 0.7, 0.9, 0.99):
        assert acceptance_for_noise(base, noise_for_acceptance(base, a)) == pytest.approx(a, abs=1e-9)
    with pytest.raises(ConfigError, match="not reachable"):
        noise_for_acceptance(base, 0.05)


def test_logits_depend_on_context_and_truncate_rolls_back():
    m = SyntheticBackend(SyntheticModelConfig(), slots=2)
    m.reset(0)
    m.reset(1)
    a = m.forward(torch.tensor([0, 1]), torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([3, 3]))
    assert torch.equal(a[0], a[1])                                # same context, same logits
    assert not torch.equal(a[0, 0], a[0, 1])                      # different contexts
    m.truncate(torch.tensor([0]), [1])
    assert m.tokens(0) == [1] and m.tokens(1) == [1, 2, 3]
    b = m.forward(torch.tensor([0]), torch.tensor([[2, 3]]), torch.tensor([2]))
    assert torch.equal(b[0], a[0, 1:])                            # recomputed after rollback


def test_ragged_inputs_write_only_each_rows_tokens():
    m = SyntheticBackend(SyntheticModelConfig(), slots=2)
    m.reset(0)
    m.reset(1)
    m.forward(torch.tensor([0, 1]), torch.tensor([[1, 2, 3], [4, -1, -1]]), torch.tensor([3, 1]))
    assert m.tokens(0) == [1, 2, 3] and m.tokens(1) == [4]


def test_mismatch_changes_greedy_choices_in_some_contexts_only():
    cfg = SyntheticModelConfig(contexts=200)
    p = SyntheticBackend(cfg).log_table.argmax(-1)
    q = SyntheticBackend(cfg, noise=0.2, mismatch=0.3).log_table.argmax(-1)
    differs = (p != q).float().mean().item()
    assert 0.15 < differs < 0.45


def test_char_tokenizer_round_trip_and_clear_error():
    tok = CharTokenizer(64)
    assert tok.decode(tok.encode("def fib(n):\n")) == "def fib(n):\n"
    with pytest.raises(Exception, match="alphabet lacks: 'Z'"):
        tok.encode("Z")


def test_config_validation():
    with pytest.raises(ConfigError, match="noise"):
        SyntheticDraftConfig(noise=-0.1)
    with pytest.raises(ConfigError, match="eos_token_id"):
        SyntheticModelConfig(eos_token_id=99)
