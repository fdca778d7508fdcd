"""The head's training loop: random windows, AdamW with warm-up and cosine decay, checkpoints
that a rerun resumes from, and the held-out acceptance figure at the end."""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import torch

from specflow.errors import ConfigError
from specflow.training.data import Sequences, save_whole
from specflow.training.ttt import chain_acceptance, chain_states, ttt_loss


@dataclass
class Settings:
    steps: int = 600
    batch: int = 4
    seq: int = 256
    ttt_steps: int = 3
    lr: float = 1e-3
    warmup: float = 0.05
    checkpoint_every: int = 100
    seed: int = 0
    bfloat16: bool = False       # the steps' products under bfloat16 autocast (weights, gradients
    #                              and the optimizer's state stay float32)


class Windows:
    """Random training windows over the sequences (longer sequences drawn more often)."""

    def __init__(self, seqs: Sequences, head_rows: torch.Tensor, seq: int, steps: int,
                 weights: list[float] | None = None):
        self.seqs = seqs
        self.device = head_rows.device              # windows are built on the host, then moved
        self.rows = head_rows                      # [Vd, E] the target's LM head, draft vocab rows
        self.T = seq
        self.steps = steps
        lengths = torch.tensor([len(t) for t in seqs.tokens], dtype=torch.float)
        self.weights = (lengths - 2).clamp(min=1)                   # [N] by positions
        if weights is not None:          # and by each sequence's own weight [N]
            self.weights = self.weights * torch.tensor(weights, dtype=torch.float)

    def draw(self, batch: int, gen: torch.Generator, index: list[int] | None = None,
             offset: list[int] | None = None):
        T, S = self.T, self.steps
        picks = index if index is not None else \
            torch.multinomial(self.weights, batch, replacement=True, generator=gen).tolist()
        width = self.seqs.states[0].shape[-1]
        E = self.seqs.finals[0].shape[-1]
        states = torch.zeros(len(picks), T, width)
        finals = torch.zeros(len(picks), T + S, E)
        tokens = torch.full((len(picks), T + 1 + S), -1, dtype=torch.long)
        offs = []
        for r, i in enumerate(picks):
            n = len(self.seqs.tokens[i])
            if offset is not None:
                o = offset[r]
            else:
                o = int(torch.randint(0, max(1, n - T - 1), (1,), generator=gen))
            offs.append(o)
            m = min(T, n - o)
            states[r, :m] = self.seqs.states[i][o:o + m].float()
            f = self.seqs.finals[i][o + 1:o + 1 + T + S].float()
            finals[r, :len(f)] = f
            t = self.seqs.tokens[i][o:o + T + 1 + S]
            tokens[r, :len(t)] = t
        dev = self.device
        states, finals, tokens = states.to(dev), finals.to(dev), tokens.to(dev)
        valid = tokens >= 0
        rows = self.rows

        def target_logits(j: int) -> torch.Tensor:         # [B, T, Vd]
            return finals[:, j:j + T] @ rows.T
        return states, tokens, valid, torch.tensor(offs, device=dev), target_logits


def lr_at(step: int, s: Settings) -> float:
    warm = max(1, int(s.warmup * s.steps))
    if step < warm:
        return s.lr * (step + 1) / warm
    progress = (step - warm) / max(1, s.steps - warm)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(path: pathlib.Path, head, opt, step: int, gen: torch.Generator) -> None:
    save_whole({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                "rng": gen.get_state()}, path)


def train(head, windows: Windows, s: Settings, checkpoint: pathlib.Path, resume: bool,
          advance, note=lambda text: None) -> list[dict]:
    """Train in place; returns the log (loss and per-step accuracy every checkpoint). note(text)
    hears where a resumed run starts."""
    # denormal floats (tiny gradients and Adam moments late in training) run ~100x slower on
    # x86 CPUs: steps slowed from 0.5 s to 1.6 s before this
    torch.set_flush_denormal(True)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(s.seed)
    start = 0
    if resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        try:
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
        except (RuntimeError, ValueError, KeyError) as exc:   # other sizes (sizes mismatch)
            raise ConfigError(f"{checkpoint} holds a head of other sizes ({type(exc).__name__}); "
                              f"pick another train_head.output, delete the folder, or pass "
                              f"train_head.resume=false") from None
        gen.set_state(state["rng"])
        start = int(state["step"])
        note(f"resuming training at step {start} of {s.steps} from {checkpoint}")
        advance(start)
    log: list[dict] = []
    head.train()
    running, acc = 0.0, []
    for step in range(start, s.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        states, tokens, valid, offs, target_logits = windows.draw(s.batch, gen)
        with torch.autocast(states.device.type, dtype=torch.bfloat16, enabled=s.bfloat16):
            loss, acc = ttt_loss(head, states, tokens, target_logits, s.ttt_steps, offs, valid)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        value = float(loss.detach())
        running = value if step == start else 0.9 * running + 0.1 * value
        advance(1, loss=running, acc=acc[0])
        if (step + 1) % s.checkpoint_every == 0 or step + 1 == s.steps:
            save_checkpoint(checkpoint, head, opt, step + 1, gen)
            log.append({"step": step + 1, "loss": round(running, 4),
                        "accuracy_by_step": [round(a, 4) for a in acc]})
    head.eval()
    return log


@torch.no_grad()
def heldout_acceptance(head, windows: Windows, k: int) -> dict:
    """Greedy acceptance on held-out sequences the target wrote: at every generated position,
    how many consecutive head drafts (each step fed the head's own state, the true previous
    tokens, as after accepted drafts) equal the target's own next tokens. -> τ at draft length
    k and α per step (k steps are run; `windows` are drawn with steps >= k)."""
    seqs = windows.seqs
    runs = []
    for i in range(len(seqs)):
        n = len(seqs.tokens[i])
        for o in range(0, max(1, n - 2), windows.T):
            states, tokens, valid, offs, target_logits = windows.draw(1, None, [i], [o])
            hits = _hits(head, states, tokens, valid, offs, k)                     # [T, k]
            first = max(0, seqs.prompt_lens[i] - 2 - o)           # roots inside the continuation
            ok = valid[0, 2:2 + windows.T][first:]                # the first draft is a real token
            h = hits[first:][ok]
            run = h.long().cumprod(-1).sum(-1)                    # consecutive hits from step 0
            runs.append(run)
    runs_t = torch.cat(runs) if runs else torch.zeros(0)
    out = chain_acceptance(runs_t, k)
    out["positions"] = int(runs_t.numel())
    return out


def _hits(head, states, tokens, valid, offs, k) -> torch.Tensor:
    """[T, k] bool: step j's argmax (on the target vocabulary) equals the true token, where the
    token exists (missing tokens count as misses)."""
    T = states.shape[1]
    hits = []
    for j, h in enumerate(chain_states(head, states, tokens, offs, k)):
        guess = head.draft_ids[head.logits(h).argmax(-1)]                           # [1, T]
        truth = tokens[:, 2 + j:2 + j + T]
        hits.append((guess == truth) & valid[:, 2 + j:2 + j + T])
    return torch.stack(hits, -1)[0]
