"""Chat data without a dataset: the target writes the user turns itself, then answers them.

An instruction-tuned model given its chat template only up to the start of a user turn (the
"pre-query template") samples something a user would ask, because that is what followed those
tokens in its own tuning data (Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis from
Scratch by Prompting Aligned LLMs with Nothing", arXiv:2406.08464). train-head uses it so a head
for a chat model sees chat-shaped text, offline: `train_head.chat_turns=N` samples N user turns
(temperature 1, top-p 0.95, fixed seeds), and each becomes a prompt through the chat template,
which the target then continues like any other (data.continuations; the wrapping is the chat
workloads' own, workloads.apply_chat_template).
"""
from __future__ import annotations

MARK = "\x00specflow-user-turn\x00"
TURN_TOKENS = 64          # most tokens a sampled user turn may take (longer ones are dropped)
SAMPLING = {"temperature": 1.0, "top_p": 0.95}


def pre_query_template(tokenizer) -> str:
    """The chat template's text up to where a user turn's content starts (its default system
    turn included), or ConfigError when the tokenizer has no chat template."""
    from specflow.errors import ConfigError

    tok = getattr(tokenizer, "tok", tokenizer)
    if not getattr(tok, "chat_template", None):
        raise ConfigError("train_head.chat_turns > 0 needs a target with a chat template (an "
                          "instruction-tuned model); this tokenizer has none: set "
                          "train_head.chat_turns=0")
    text = tok.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False,
                                   add_generation_prompt=False)
    return text[:text.index(MARK)]


def sampling_config(run_cfg):
    """The run's config with a temperature and top-p processor (the values are per request)."""
    from omegaconf import OmegaConf, open_dict

    cfg = run_cfg.copy()
    with open_dict(cfg):
        cfg.logits = OmegaConf.create({"temperature": {"name": "temperature", "value": 1.0},
                                       "top_p": {"name": "top_p", "p": 0.95}})
    return cfg


def sample_user_turns(pipe, count: int, seed: int, advance) -> list[str]:
    """`count` distinct user turns the target writes after its pre-query template (a sampling
    pipeline: see sampling_config). Turns that do not end within TURN_TOKENS, that are empty or
    that repeat one already kept are dropped, and more are drawn, up to 4 x count in all."""
    return draw_user_turns(pipe, count, seed, advance, 0)[0]


def draw_user_turns(pipe, count: int, seed: int, advance, start: int) -> tuple[list[str], int]:
    """sample_user_turns from draw `start` on (draw i is request index i: its seed offset, so
    later draws are new ones) -> (the turns, the draw after the last one taken)."""
    template = pre_query_template(pipe.tokenizer)
    kept: dict[str, None] = {}
    drawn = start
    while len(kept) < count and drawn < start + 4 * count:
        n = count - len(kept)
        ended = _draw(pipe, template, seed, list(range(drawn, drawn + n)), kept, advance)
        drawn += n
        for index in sorted(ended):         # in request order: the same turns for any timing
            kept[ended[index]] = None
    return list(kept)[:count], drawn


def _draw(pipe, template: str, seed: int, indices: list[int], kept: dict, advance) -> dict:
    """{request index: turn} of the turns that ended; `advance` moves as each new one does."""
    ended: dict[int, str] = {}

    def done(result):
        text = result.text.strip()
        if result.finish_reason in ("eos", "stop") and text:
            if text not in kept and text not in ended.values():
                advance(1)
            ended[result.index] = text
    pipe.generate([template] * len(indices), max_new_tokens=TURN_TOKENS, seed=seed,
                  sampling=SAMPLING, indices=indices, on_result=done)
    return ended


def interleave(first: list, second: list) -> list:
    """Both lists in one, spread evenly (the held-out share, cut from the end, has both)."""
    if not first or not second:
        return first + second
    ordered = sorted([(i / len(first), 0, x) for i, x in enumerate(first)] +
                     [(i / len(second), 1, x) for i, x in enumerate(second)],
                     key=lambda t: (t[0], t[1]))
    return [x for _, _, x in ordered]
