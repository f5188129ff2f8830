"""jaxpt.util.progress: periodic plain lines (count, rate, ETA) when not on a terminal, never carriage returns."""

import io
import os

import pytest

from jaxpt.util import progress


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_not_a_tty_gets_a_line_per_interval_with_count_rate_and_eta(monkeypatch):
    monkeypatch.delenv("JAXPT_PROGRESS", raising=False)
    out, clock = io.StringIO(), FakeClock()
    p = progress.Progress(40, "heldout", "batches", stream=out, every_s=30, clock=clock)
    assert p.mode == "lines"
    for _ in range(10):  # 10 batches, 2 s each: 20 s < 30 s, no line yet
        clock.t += 2
        p.update()
    assert out.getvalue() == ""
    for _ in range(5):  # 15 batches at 30 s: the first line
        clock.t += 2
        p.update()
    # rate 15 / 30 s = 0.5 batches/s; ETA (40 - 15) / 0.5 = 50 s
    assert out.getvalue() == "heldout: 15/40 batches (37.5%), 0.5 batches/s, elapsed 0:00:30, ETA 0:00:50\n"
    for _ in range(25):  # 40 at 80 s: one more line at 60 s (n = 30), then the final line on close
        clock.t += 2
        p.update()
    p.close()
    p.close()  # idempotent
    lines = out.getvalue().splitlines()
    assert lines[1] == "heldout: 30/40 batches (75.0%), 0.5 batches/s, elapsed 0:01:00, ETA 0:00:20"
    assert lines[2] == "heldout: 40/40 batches (100.0%), 0.5 batches/s, elapsed 0:01:20, ETA 0:00:00"
    assert len(lines) == 3 and "\r" not in out.getvalue()


def test_unknown_total_reports_count_and_rate_only():
    out, clock = io.StringIO(), FakeClock()
    with progress.Progress(None, "corpus", "documents", stream=out, every_s=10, clock=clock, mode="lines") as p:
        clock.t += 4
        p.update(10)
    assert out.getvalue() == "corpus: 10 documents, 2.5 documents/s, elapsed 0:00:04\n"


def test_a_resumed_run_counts_from_its_step_and_shows_the_loss():
    """The trainer's lines (a log file): a run resumed at step 100 of 200 reports the absolute step, the rate of
    this process only (not 100 steps in no time) and the last loss."""
    out, clock = io.StringIO(), FakeClock()
    p = progress.Progress(200, "train", "steps", stream=out, every_s=30, clock=clock, mode="lines", initial=100)
    for _ in range(15):  # 15 steps, 2 s each
        clock.t += 2
        p.update()
        p.set_postfix(loss="3.142")
    # rate 15 / 30 s = 0.5 steps/s; ETA (200 - 115) / 0.5 = 170 s
    assert out.getvalue() == ("train: 115/200 steps (57.5%), 0.5 steps/s, elapsed 0:00:30, ETA 0:02:50, "
                              "loss 3.142\n")


def test_track_yields_every_item_and_reports_each(monkeypatch):
    out, clock = io.StringIO(), FakeClock()

    def items():
        for i in range(3):
            clock.t += 1
            yield i
    assert list(progress.track(list(items()), "x", stream=out, every_s=0, clock=clock, mode="lines")) == [0, 1, 2]
    # every_s = 0: a line after each item, then the final one
    assert [ln.split(",")[0] for ln in out.getvalue().splitlines()] == ["x: 1/3 items (33.3%)",
                                                                       "x: 2/3 items (66.7%)",
                                                                       "x: 3/3 items (100.0%)",
                                                                       "x: 3/3 items (100.0%)"]


def test_a_terminal_gets_a_bar_and_the_environment_overrides(monkeypatch):
    monkeypatch.delenv("JAXPT_PROGRESS", raising=False)
    assert progress.choose_mode(Tty()) == "bar"
    assert progress.choose_mode(io.StringIO()) == "lines"
    monkeypatch.setenv("JAXPT_PROGRESS", "off")
    out = io.StringIO()
    with progress.Progress(5, "x", stream=out) as p:
        p.update(5)
    assert out.getvalue() == ""
    monkeypatch.setenv("JAXPT_PROGRESS", "sometimes")
    with pytest.raises(ValueError, match="JAXPT_PROGRESS"):
        progress.choose_mode(out)


def test_quiet_startup_sets_only_unset_variables(monkeypatch):
    for k in progress.QUIET_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("JAXPT_VERBOSE_STARTUP", raising=False)
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the user's choice stays
    progress.quiet_startup()
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
    assert os.environ["TPU_MIN_LOG_LEVEL"] == "2" and os.environ["GRPC_VERBOSITY"] == "ERROR"


def test_duration_format():
    assert progress.format_duration(3725.4) == "1:02:05"
    assert progress.format_duration(float("inf")) == "?"


def test_a_phase_says_when_it_starts_beats_while_it_runs_and_says_when_it_ends():
    """A long step of unknown length (an 8B compile printed nothing for 18 minutes on a busy host) reports itself."""
    import io
    import time as time_lib

    from jaxpt.util.progress import Phase
    out = io.StringIO()
    beats = lambda: [ln for ln in out.getvalue().splitlines() if ln.startswith("... still compiling (0:00:0")]  # noqa: E731
    with Phase("compiling the train step for v5p:4x4x4 (64 chips)", stream=out, every_s=0.05) as phase:
        # until two beats (a loaded host may not run the beat thread every 0.05 s): at most 5 s
        deadline = time_lib.monotonic() + 5
        while len(beats()) < 2 and time_lib.monotonic() < deadline:
            time_lib.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[0] == "compiling the train step for v5p:4x4x4 (64 chips) ..."
    assert len(beats()) >= 2
    assert lines[-1].startswith("... done in 0:00:0") and 0.1 <= phase.seconds < 6


def test_greedy_generation_reports_its_prompts(monkeypatch, capsys):
    """Evaluation's spot-check generations ran 109 s without a line; greedy decoding now reports its prompts."""
    import numpy as np

    from jaxpt.infer import decode

    class Step:  # a DecodeStep whose next token is always 3
        seq_len, batch_size = 16, 2

        def prefill(self, prompts):
            return len(prompts), np.eye(5)[[3] * len(prompts)]

        def extend(self, state, tokens):
            return state, np.eye(5)[[3] * state]

    monkeypatch.setenv("JAXPT_PROGRESS", "lines")
    gens = decode.greedy(Step(), [[1, 2], [1], [2, 2, 2]], 4, progress="spot-check generations")
    assert [g.ids for g in gens] == [[3, 3, 3, 3]] * 3
    err = capsys.readouterr().err
    assert "spot-check generations: 3/3 prompts (100.0%)" in err
