"""Progress off a terminal (specflow/app/progress.py): plain lines when a phase starts, every
`every` seconds of a fake clock while it runs, and when it ends."""
from __future__ import annotations

from specflow.app.progress import PlainPhases


def test_plain_phases_write_a_line_at_start_every_interval_and_at_the_end():
    lines, now = [], [0.0]
    phases = PlainPhases(lines.append, every=30.0, clock=lambda: now[0])
    advance = phases("training", 100)
    for step in range(100):
        now[0] = step * 1.0                     # a step a second
        advance(1, loss=2.0 - step / 100, acc=0.5)
    assert lines[0] == "specflow: training: 0/100"
    assert lines[1].startswith("specflow: training: 31/100 (31%), 30 s, loss ")
    assert [line.split(":")[2].split(",")[0].strip() for line in lines[1:]] == \
        ["31/100 (31%)", "61/100 (61%)", "91/100 (91%)", "100/100 (100%)"]
    phases.note("resuming training at step 40 of 100")
    assert lines[-1] == "specflow: resuming training at step 40 of 100"


def test_a_phase_without_steps_still_ends_with_a_line():
    lines = []
    advance = PlainPhases(lines.append, clock=lambda: 0.0)("target writes user turns", 0)
    advance(0)
    assert lines == ["specflow: target writes user turns: 0/0",
                     "specflow: target writes user turns: 0/0, 0 s"]


def test_a_heartbeat_says_it_is_still_busy_until_the_step_ends():
    import threading

    from specflow.app.progress import Heartbeat

    lines, beat = [], threading.Event()

    def write(text):
        lines.append(text)
        beat.set()

    with Heartbeat(write, "loading the model", every=0.01):
        assert beat.wait(30)                     # at least one line while the step runs
    count = len(lines)
    assert lines[0].startswith("specflow: still loading the model (")
    threading.Event().wait(0.05)
    assert len(lines) == count                   # none after it ended
