"""Self-distillation data for a draft head: the target's own continuations and hidden states.

The target continues each prompt (plain decoding, the run's logits settings, batched) and what
the head learns from is recorded from the same passes (`StateRecorder`): for every position the
inputs of the layers the head reads ([T, nE]) and the target's final normed state ([T, E]), from
which the target's next-token distribution is recomputed in training (storing [T, V] logits
would cost V / E times more memory). A sequence's last token is never fed (decoding stops after
choosing it), so it is left out. A long data phase is decoded and saved in parts
(`continuations_in_parts`), so an interrupted one resumes.
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch

from specflow.plugins import hookimpl


@dataclass
class Sequences:
    """Token sequences with the target's states, concatenated (fp16 on the host)."""

    tokens: list[torch.Tensor]        # [T_i] long each
    states: list[torch.Tensor]        # [T_i, nE] the head's inputs (fp16)
    finals: list[torch.Tensor]        # [T_i, E] the target's last normed state (fp16)
    prompt_lens: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    heldout_count: int | None = None  # set where the held-out ones were chosen otherwise
    kinds: list[int] | None = None    # [N] each sequence's kind (head_data.KINDS), where the
    #                                     sequences came from a head-data folder

    def heldout_share(self, heldout: float) -> int:
        """How many of the last sequences a share `heldout` holds out (at least one)."""
        return max(1, round(heldout * len(self))) if heldout > 0 else 0

    def split(self, heldout: float) -> tuple["Sequences", "Sequences"]:
        """(train, held-out): the last round(heldout * n) sequences (at least one) are held out."""
        return self.split_last(self.heldout_share(heldout))

    def split_last(self, n_out: int) -> tuple["Sequences", "Sequences"]:
        """(train, held-out): the last n_out sequences are held out."""
        cut = len(self) - n_out

        def part(sl):
            return Sequences(self.tokens[sl], self.states[sl], self.finals[sl],
                             self.prompt_lens[sl],
                             kinds=None if self.kinds is None else self.kinds[sl])
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


class StateRecorder:
    """A pipeline plugin that keeps the target's states of every position it feeds while it
    decodes: the inputs of `layer_ids` and the final normed state (specflow_hidden_layers'
    index num_layers), per request, as fp16 chunks where the target runs (moved to the host
    once per finished request, not in the round loop). Under proposer=none every fed position
    is committed, so a request's chunks are its sequence's states in order."""

    def __init__(self, layer_ids: list[int], num_layers: int):
        self.layers = (*layer_ids, num_layers)           # the final state last
        self.slot_request: dict[int, int] = {}           # slot -> request_id decoding in it
        self.chunks: dict[int, list[tuple[int, torch.Tensor]]] = {}  # request_id -> (start, [n, (k+1)E])

    @hookimpl
    def specflow_hidden_layers(self):
        return list(self.layers)

    @hookimpl
    def specflow_request_start(self, slot, request):
        self.slot_request[slot] = request.request_id
        self.chunks[request.request_id] = []

    @hookimpl
    def specflow_target_states(self, states):
        hidden = states.select(self.layers).half()                        # [B, T, (k+1)E]
        for b, (slot, start, n) in enumerate(zip(states.slots, states.starts, states.lens)):
            if n:
                self.chunks[self.slot_request[slot]].append((start, hidden[b, :n]))

    def take(self, request_id: int, positions: int) -> torch.Tensor | None:
        """The request's states of its first `positions` positions [positions, (k+1)E] on the
        host (None for none), released here; ValueError when they were not all recorded, in
        order."""
        chunks = self.chunks.pop(request_id, [])
        if positions == 0:
            return None
        at = 0
        for start, part in chunks:
            if start != at:
                raise ValueError(f"request {request_id}: states recorded from position {start}, "
                                 f"expected {at}")
            at += len(part)
        if at < positions:
            raise ValueError(f"request {request_id}: {at} positions recorded, {positions} needed")
        return torch.cat([part for _, part in chunks])[:positions].cpu()


def continuations(pipe, prompts: list[str], new_tokens: int, advance,
                  recorder: StateRecorder | None = None):
    """(prompt + the target's continuation of each prompt as token ids, the prompt's length in
    each, the recorded states of each), in prompt order, leaving out sequences of 3 tokens or
    fewer (nothing to learn): lengths and states stay paired with their sequences whichever are
    left out.

    With a recorder registered on `pipe`, each kept sequence's states [T, (k+1)E], the sequence
    cut to the positions fed (its last token never is); without one, None for each."""
    out: list[tuple[list[int], int, torch.Tensor | None] | None] = [None] * len(prompts)

    def done(result):
        prompt = list(pipe.tokenizer.encode(result.prompt))
        ids = prompt + result.token_ids
        states = None
        if recorder is not None:
            ids = ids[:-1]
            states = recorder.take(result.index, len(ids))
        out[result.index] = (ids, len(prompt), states)
        advance()
    pipe.generate(prompts, max_new_tokens=new_tokens, on_result=done)
    kept = [row for row in out if row is not None and len(row[0]) > 3]
    return [ids for ids, _, _ in kept], [n for _, n, _ in kept], [st for _, _, st in kept]


def save_whole(obj, path: pathlib.Path) -> None:
    """torch.save to `path` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


PART_SEQUENCES = 256      # prompts decoded and saved together in continuations_in_parts


def continuations_in_parts(pipe, prompts: list[str], new_tokens: int, advance,
                           recorder: StateRecorder, folder: pathlib.Path,
                           note=lambda text: None):
    """continuations() with a recorder, PART_SEQUENCES prompts at a time, each part saved to
    `folder` (part-NNNN.pt, with its prompts) as soon as it is decoded; a part already there
    that holds the same prompts is loaded instead of decoded again, so an interrupted data phase
    (Ctrl-C, a lost machine) resumes where it stopped -> (sequences, lengths, states);
    note(text) hears how many it read back."""
    folder.mkdir(parents=True, exist_ok=True)
    sequences, lens, states = [], [], []
    reused = 0
    for i, at in enumerate(range(0, len(prompts), PART_SEQUENCES)):
        chunk = prompts[at:at + PART_SEQUENCES]
        path = folder / f"part-{i:04d}.pt"
        part = torch.load(path, weights_only=False) if path.is_file() else None
        if part is not None and part["prompts"] == chunk:
            reused += len(chunk)
            for _ in chunk:
                advance()
        else:
            if reused and at == reused:
                note(f"resuming the data phase: {reused} of {len(prompts)} sequences were "
                     f"decoded earlier (read from {folder}); decoding the rest")
            got = continuations(pipe, chunk, new_tokens, advance, recorder)
            part = dict(zip(("sequences", "lens", "states"), got), prompts=chunk)
            save_whole(part, path)
        sequences += part["sequences"]
        lens += part["lens"]
        states += part["states"]
    if reused == len(prompts):
        note(f"resuming: all {reused} sequences were decoded earlier (read from {folder})")
    return sequences, lens, states


def recorded_sequences(sequences: list[list[int]], prompt_lens: list[int],
                       states: list[torch.Tensor], num_aux: int) -> Sequences:
    """Sequences from a StateRecorder's states: the first `num_aux` layers' inputs, then the
    final normed state, split per sequence. `states` is emptied as it is split (each [T, (k+1)E]
    dropped once its two parts are copied), so the data is held once, not twice."""
    tokens, aux, finals = [], [], []
    for i, ids in enumerate(sequences):
        s, states[i] = states[i], None
        cut = s.shape[1] // (num_aux + 1) * num_aux
        tokens.append(torch.tensor(ids))
        aux.append(s[:, :cut].contiguous())                                        # [T, nE]
        finals.append(s[:, cut:].contiguous())                                     # [T, E]
        del s
    states.clear()
    return Sequences(tokens, aux, finals, list(prompt_lens))


def draft_vocabulary(seqs: Sequences, size: int, vocab: int,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent tokens of the sequences' generated parts (the tokens the head
    must predict), sorted by id; all of them when size >= vocab. `keep` [n <= size]: ids taken
    first whatever their counts (a vocabulary grown from a smaller one)."""
    if size >= vocab:
        return torch.arange(vocab)
    counts = torch.zeros(vocab, dtype=torch.long)
    for t, p in zip(seqs.tokens, seqs.prompt_lens):
        counts += torch.bincount(t[max(p, 1):], minlength=vocab)
    if keep is not None:
        counts[keep] = counts.sum() + 1                      # above every count: taken first
    return counts.topk(size).indices.sort().values
