"""Atomic local writes (``jaxpt.util.fs.replace_local``, behind ``write_text_atomic``, figures, the tokenizer, the
prepared sample and the corpus build's label files): a unique temporary file per write, then a rename. A fixed
``<path>.tmp`` made two writers of one file collide (a writer's rename found its temporary file gone, and a reader
saw a file half-written by the other) and followed a link planted at that predictable name."""

import os
import pathlib
import subprocess
import sys
import threading

import pytest

from jaxpt.util import fs

WRITER = """
import sys
from jaxpt.util import fs
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(n):
    fs.write_text_atomic(path, (tag * 20000) + f"|{i}\\n")
"""


@pytest.mark.integration
def test_two_writers_of_one_file_never_collide_and_a_reader_never_sees_half(tmp_path):
    path = tmp_path / "run.json"
    fs.write_text_atomic(path, "a" * 20000 + "|start\n")
    torn, reads, stop = [], [0], threading.Event()

    def read():
        while not stop.is_set():
            text = path.read_text()
            reads[0] += 1
            body, _, tail = text.partition("|")
            if len(body) != 20000 or len(set(body)) != 1 or not tail.endswith("\n"):
                torn.append(len(text))

    reader = threading.Thread(target=read)
    reader.start()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), tag, "300"], stderr=subprocess.PIPE, text=True)
             for tag in "ab"]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    stop.set()
    reader.join()
    assert [p.returncode for p in procs] == [0, 0], errors
    assert torn == [] and reads[0] > 0
    assert path.read_text().endswith(("|299\n",))
    assert [n for n in os.listdir(tmp_path) if n != "run.json"] == []  # no temporary file left behind


def test_a_link_planted_at_the_old_temporary_name_is_not_followed(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(target, run / "config.gin.tmp")
    fs.write_text_atomic(run / "config.gin", "TrainConfig.steps = 1\n")
    assert target.read_text() == "keep"
    assert (run / "config.gin").read_text() == "TrainConfig.steps = 1\n"


def test_the_file_gets_the_mode_a_plain_write_would_give(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    fs.write_text_atomic(tmp_path / "atomic", "x")
    assert (pathlib.Path(tmp_path / "atomic").stat().st_mode & 0o777) == (plain.stat().st_mode & 0o777)
