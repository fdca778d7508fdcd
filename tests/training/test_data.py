"""training/data.py: the target's continuations, paired with their prompts' lengths."""
from __future__ import annotations

from types import SimpleNamespace

from specflow.training import data


class Pipe:
    """Encodes a prompt as one token per character; 'continues' it with `added[prompt]` tokens,
    finishing the requests in reverse order."""

    def __init__(self, added: dict[str, list[int]]):
        self.added = added
        self.tokenizer = SimpleNamespace(encode=lambda text: [ord(c) for c in text])

    def generate(self, prompts, max_new_tokens, on_result):
        for i in reversed(range(len(prompts))):
            on_result(SimpleNamespace(index=i, prompt=prompts[i],
                                      token_ids=self.added[prompts[i]][:max_new_tokens]))


def test_a_sequence_left_out_in_the_middle_keeps_the_others_paired_with_their_lengths():
    prompts = ["abcd", "x", "hello world"]
    pipe = Pipe({"abcd": [1, 2], "x": [3], "hello world": [4, 5, 6]})
    seen = []
    seqs, lens, states = data.continuations(pipe, prompts, 8, lambda: seen.append(1))
    assert len(seen) == 3
    assert seqs == [[97, 98, 99, 100, 1, 2], [*map(ord, "hello world"), 4, 5, 6]]
    assert lens == [4, 11]           # "x" + 1 token is too short: left out with its length
    assert states == [None, None]    # nothing recorded without a StateRecorder
