"""Self-distillation data for a draft head: the target's own continuations and hidden states.

The target continues each prompt (plain decoding, the run's logits settings, batched), then one
more forward over every whole sequence records what the head learns from: the inputs of the
layers the head reads ([T, nE]) and the target's final normed state ([T, E]), from which the
target's next-token distribution is recomputed in training (storing [T, V] logits would cost
V / E times more memory).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sequences:
    """Token sequences with the target's states, concatenated (fp16 on the host)."""

    tokens: list[torch.Tensor]        # [T_i] long each
    states: list[torch.Tensor]        # [T_i, nE] the head's inputs (fp16)
    finals: list[torch.Tensor]        # [T_i, E] the target's last normed state (fp16)
    prompt_lens: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    def split(self, heldout: float) -> tuple["Sequences", "Sequences"]:
        """(train, held-out): the last ceil(heldout * n) sequences are held out."""
        n_out = max(1, round(heldout * len(self))) if heldout > 0 else 0
        cut = len(self) - n_out

        def part(sl):
            return Sequences(self.tokens[sl], self.states[sl], self.finals[sl],
                             self.prompt_lens[sl])
        return part(slice(0, cut)), part(slice(cut, None))

    def positions(self) -> int:
        return sum(len(t) for t in self.tokens)


def cut_prompts(prompts: list[str], tokenizer, prompt_tokens: int, count: int) -> list[str]:
    """The first `count` distinct prompts, each cut to its first `prompt_tokens` tokens (never
    cycled: a repeated prompt repeats its greedy continuation and would leak into the held-out
    figure)."""
    out: dict[str, None] = {}
    for prompt in prompts:
        ids = tokenizer.encode(prompt)
        cut = tokenizer.decode(ids[:prompt_tokens]) if len(ids) > prompt_tokens else prompt
        if cut.strip():
            out[cut] = None
        if len(out) == count:
            break
    return list(out)


def continuations(pipe, prompts: list[str], new_tokens: int,
                  advance) -> tuple[list[list[int]], list[int]]:
    """(prompt + the target's continuation of each prompt as token ids, the prompt's length in
    each), in prompt order, leaving out sequences of 3 tokens or fewer (nothing to learn): the
    lengths stay paired with their sequences whichever are left out."""
    out: list[tuple[list[int], int] | None] = [None] * len(prompts)

    def done(result):
        prompt = list(pipe.tokenizer.encode(result.prompt))
        out[result.index] = (prompt + result.token_ids, len(prompt))
        advance()
    pipe.generate(prompts, max_new_tokens=new_tokens, on_result=done)
    kept = [pair for pair in out if pair is not None and len(pair[0]) > 3]
    return [ids for ids, _ in kept], [n for _, n in kept]


@torch.inference_mode()
def target_states(model, sequences: list[list[int]], layer_ids: list[int], prompt_lens: list[int],
                  advance, batch: int = 8) -> Sequences:
    """One forward of the target (transformers' own, no cache) over each sequence."""
    tokens, states, finals = [], [], []
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    kept: dict[int, tuple] = {}
    for at in range(0, len(order), batch):
        group = order[at:at + batch]
        width = len(sequences[group[0]])
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for r, i in enumerate(group):
            ids[r, :len(sequences[i])] = torch.tensor(sequences[i])
            mask[r, :len(sequences[i])] = 1
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                    output_hidden_states=True, use_cache=False, logits_to_keep=1)
        hs = out.hidden_states                       # inputs of each layer, then the normed output
        aux = torch.cat([hs[j] for j in layer_ids], -1)                          # [G, T, nE]
        final = hs[-1]                                                            # [G, T, E]
        for r, i in enumerate(group):
            n = len(sequences[i])
            kept[i] = (torch.tensor(sequences[i]), aux[r, :n].half().cpu(),
                       final[r, :n].half().cpu())
        advance(len(group))
    for i in range(len(sequences)):
        t, s, f = kept[i]
        tokens.append(t)
        states.append(s)
        finals.append(f)
    return Sequences(tokens, states, finals, list(prompt_lens))


def draft_vocabulary(seqs: Sequences, size: int, vocab: int) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences' generated parts (the tokens the head
    must predict), sorted by id; all of them when size >= vocab."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for t, p in zip(seqs.tokens, seqs.prompt_lens):
        counts += torch.bincount(t[max(p, 1):], minlength=vocab)
    return counts.topk(size).indices.sort().values
