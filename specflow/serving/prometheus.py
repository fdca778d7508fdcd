"""/metrics in Prometheus' text format: requests, tokens, and speculation counters in the spirit
of vLLM's spec_decode metrics (drafted and accepted tokens, acceptance per draft position)."""
from __future__ import annotations


def _line(out: list[str], name: str, kind: str, help_: str, samples) -> None:
    out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        tag = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        out.append(f"{name}{tag} {value}")


def render(worker) -> str:
    total = worker.engine.recorder.total
    out: list[str] = []
    _line(out, "specflow_requests_running", "gauge", "Requests in the running batch.",
          [({}, worker.running)])
    _line(out, "specflow_requests_waiting", "gauge", "Requests queued for a slot.",
          [({}, worker.waiting)])
    _line(out, "specflow_requests_total", "counter", "Finished requests by finish reason.",
          [({"finish_reason": r}, n) for r, n in sorted(worker.finished.items())] or
          [({"finish_reason": "stop"}, 0)])
    _line(out, "specflow_prompt_tokens_total", "counter", "Prompt tokens admitted.",
          [({}, worker.prompt_tokens)])
    _line(out, "specflow_generation_tokens_total", "counter", "Tokens streamed to clients.",
          [({}, worker.generation_tokens)])
    _line(out, "specflow_spec_decode_num_rounds_total", "counter", "Rows x rounds decoded.",
          [({}, total.num_rounds)])
    _line(out, "specflow_spec_decode_num_target_passes_total", "counter",
          "Target passes (one per row and round).", [({}, total.num_target_passes)])
    _line(out, "specflow_spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
          [({}, total.num_draft_tokens)])
    _line(out, "specflow_spec_decode_num_accepted_tokens_total", "counter",
          "Draft tokens accepted.", [({}, total.num_accepted_tokens)])
    accepted = list(total.accepted_per_position)
    examined = list(total.examined_per_position)
    _line(out, "specflow_spec_decode_num_accepted_tokens_per_pos_total", "counter",
          "Draft tokens accepted, by position in the draft (0 = first).",
          [({"position": i}, n) for i, n in enumerate(accepted)])
    _line(out, "specflow_spec_decode_num_examined_tokens_per_pos_total", "counter",
          "Draft tokens the verifier reached, by position.",
          [({"position": i}, n) for i, n in enumerate(examined)])
    rate = total.num_accepted_tokens / total.num_draft_tokens if total.num_draft_tokens else 0.0
    _line(out, "specflow_spec_decode_draft_acceptance_rate", "gauge",
          "Accepted over proposed draft tokens since start.", [({}, round(rate, 6))])
    return "\n".join(out) + "\n"
