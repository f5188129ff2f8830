"""The corpus build's progress lines (`data_pipelines.progress`): counts, rate and ETA of reading, computed by hand;
periodic lines from the background thread when not on a terminal; nothing when off. The end-to-end check (the last
line of a real build equals its manifest's counts) is in tests/test_object_storage.py."""

import io
import time

import pytest

pytest.importorskip("apache_beam")

from data_pipelines import progress  # noqa: E402


def test_line_counts_rate_and_reading_eta_by_hand():
    counts = {"files": 1, "read": 30, "kept": 20, "heldout": 2, "dropped": 8}
    # 30 documents in 10 s = 3/s; 1 of 4 files in 10 s -> 3 files left at 0.1 files/s = 30 s
    assert progress.format_line(counts, 4, 10.0) == (
        "corpus build: 1/4 input files (25.0%), 30 documents read (3 documents/s), 20 kept, 2 held out, "
        "8 dropped, elapsed 0:00:10, ETA of reading 0:00:30")
    done = dict(counts, files=4)
    assert progress.format_line(done, 4, 75.0).endswith("elapsed 0:01:15, reading done")
    assert progress.format_line(dict(counts, files=0, read=0), 4, 0.0).endswith("ETA of reading ?")


def test_periodic_lines_then_the_final_one():
    """Lines mode: the thread writes a line every ``every_s`` while the build runs, and the exit writes the final
    one with the counts at the end; the counters start from zero at each build."""
    now = [0.0]
    buf = io.StringIO()
    progress.count("read", 99)  # a previous build's count: reset on entry
    with progress.BuildProgress(4, stream=buf, every_s=0.01, mode="lines", clock=lambda: now[0]):
        progress.count("files")
        for kind, k in (("read", 30), ("kept", 20), ("heldout", 2), ("dropped", 8)):
            progress.count(kind, k)
        deadline = time.monotonic() + 10
        while buf.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        now[0] = 10.0
    lines = buf.getvalue().splitlines()
    assert len(lines) >= 3 and all(x.startswith("corpus build: ") for x in lines)
    assert lines[-1] == ("corpus build: 1/4 input files (25.0%), 30 documents read (3 documents/s), 20 kept, "
                         "2 held out, 8 dropped, elapsed 0:00:10, ETA of reading 0:00:30")
    assert "\r" not in buf.getvalue()


def test_off_writes_nothing(monkeypatch):
    monkeypatch.setenv("JAXPT_PROGRESS", "off")
    buf = io.StringIO()
    with progress.BuildProgress(2, stream=buf, every_s=0.0):
        progress.count("files", 2)
    assert buf.getvalue() == ""
    with pytest.raises(KeyError):
        progress.count("pages")
