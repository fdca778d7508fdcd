"""The benchmark scripts' own logic, without running a model: bench/drafters.py pairs every arm
with `none` at its target precision, bench/head_curve.py redraws a scored JSON."""
from __future__ import annotations

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import drafters  # noqa: E402
import head_curve  # noqa: E402


def test_drafters_arms_get_none_at_each_target_precision_first():
    arms = drafters.with_twins(["proposer=eagle dtype=float32",
                                "proposer=eagle dtype=auto proposer.dtype=int4",
                                "proposer=none dtype=float32", "proposer=draft"])
    assert arms == ["proposer=none dtype=float32", "proposer=none dtype=auto", "proposer=none",
                    "proposer=eagle dtype=float32",
                    "proposer=eagle dtype=auto proposer.dtype=int4", "proposer=draft"]


def scored(tau: float, positions: int, steps: int) -> dict:
    part = {"tau": tau, "acceptance_by_step": [0.5, 0.25, 0.1, 0.05], "positions": 100}
    return {"path": "x", "train_positions": positions, "steps": steps, "all": part,
            "code": {**part, "tau": tau + 0.3}, "chat": {**part, "tau": tau - 0.3}}


def test_head_curve_writes_table_and_plot_again_from_its_json(tmp_path, monkeypatch):
    saved = tmp_path / "curve.json"
    heads = {"first": scored(2.0, 1000, 10), "second, on from it": scored(2.5, 3000, 20),
             "third, same data": scored(2.6, 3000, 30)}
    saved.write_text(json.dumps({"folder": "head_data/x", "k": 4, "heads": heads}))
    out, png = tmp_path / "again", tmp_path / "again.png"
    monkeypatch.setattr(sys, "argv", ["head_curve.py", "--from", str(saved), "--out", str(out),
                                      "--png", str(png)])
    head_curve.main()
    table = (tmp_path / "again.md").read_text()
    assert "| second, on from it | 3,000 | 2.50 | 2.80 | 2.20 |" in table
    assert "`head_data/x` (100 generated positions)" in table
    assert json.loads((tmp_path / "again.json").read_text())["heads"] == heads
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "| code | chat | acceptance" in table and "user" not in table


def test_head_curve_gives_turns_people_wrote_a_column_where_scored(tmp_path):
    heads = {"before": scored(2.0, 1000, 10), "after": scored(2.1, 2000, 20)}
    for r, tau in zip(heads.values(), (1.79, 1.93)):
        r["user"] = {**r["all"], "tau": tau}
    head_curve.write(heads, "head_data/x", 4, str(tmp_path / "c"), str(tmp_path / "c.png"))
    table = (tmp_path / "c.md").read_text()
    assert "| code | chat | user | acceptance by step |" in table
    assert "| after | 2,000 | 2.10 | 2.40 | 1.80 | 1.93 |" in table
