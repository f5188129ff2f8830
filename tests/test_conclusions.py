"""The conclusions database (jaxpt/lab/conclusions.py, issue #36): its schema, ids that resolve, refusals that name
what they refuse, import from a real run's run.json, the program's commands, and a file on object storage."""

import json
import sqlite3

import pytest

from conftest import REPO_ROOT, tiny_bindings
from test_object_storage import gcs  # noqa: F401 - the local GCS emulator fixture (fake-gcs-server)

from jaxpt.lab import conclusions as C
from jaxpt.tools import conclusions as conclusions_cli

CARD = REPO_ROOT / "configs" / "eval" / "card_v1.yaml"
SHA = "ab" * 32
STEPS = 3


@pytest.fixture
def db(tmp_path):
    with C.ConclusionsDB(str(tmp_path / "team.sqlite")) as d:
        yield d


def _populate(db) -> dict:
    """One row of every kind; returns what was written, for comparing with what reads back."""
    db.add_data_version("raw-v1", "/corpora/raw-v1", {"domains": ["web", "code"], "tokens": 12345})
    card = db.add_eval_card("core", 2, SHA)
    db.add_experiment("mix-001", "mixture", {"k": 8, "alpha": 0.5}, "raw-v1", {"heldout/web": 1.0})
    db.add_run("run-a", data_version="raw-v1", role="proxy", experiment_id="mix-001", workdir="/w/a",
               config_hash="h1", eval_card=card, mixture=[[1, {"web": 0.25, "code": 0.75}]], flops=1.5e15,
               device_seconds=80.0, wall_s=12.5, tokens=4096, created_at="2025-01-01T00:00:00+00:00")
    db.add_metrics("run-a", {"heldout_loss": 3.25, "step": 8})
    cid = db.add_conclusion("code-heavy mixtures lower web loss", ["run-a", "raw-v1", card], experiment_id="mix-001",
                            author="tester")
    return {"card": card, "conclusion": cid}


def test_schema_round_trip_every_kind_reads_back_as_written_after_reopening(tmp_path):
    path = str(tmp_path / "team.sqlite")
    with C.ConclusionsDB(path) as db:
        ids = _populate(db)
    with C.ConclusionsDB(path) as db:  # a fresh engine on the same file
        assert db.resolve("raw-v1") == ("data_version", {"id": "raw-v1", "path": "/corpora/raw-v1",
                                                         "details": {"domains": ["web", "code"], "tokens": 12345}})
        assert db.resolve(ids["card"]) == ("eval_card", {"id": "core@v2", "name": "core", "version": 2,
                                                         "content_sha256": SHA})
        exp = db.experiment("mix-001")
        assert (exp["kind"], exp["config"], exp["data_version"], exp["target"], exp["status"]) == \
            ("mixture", {"k": 8, "alpha": 0.5}, "raw-v1", {"heldout/web": 1.0}, "running")
        assert exp["runs"] == ["run-a"] and exp["conclusions"] == [ids["conclusion"]]
        kind, run = db.resolve("run-a")
        assert kind == "run" and run == {
            "id": "run-a", "experiment_id": "mix-001", "role": "proxy", "workdir": "/w/a", "config_hash": "h1",
            "data_version": "raw-v1", "eval_card": "core@v2", "mixture": [[1, {"web": 0.25, "code": 0.75}]],
            "flops": 1.5e15, "device_seconds": 80.0, "wall_s": 12.5, "tokens": 4096,
            "created_at": "2025-01-01T00:00:00+00:00", "metrics": {"heldout_loss": 3.25, "step": 8.0}}
        (c,) = db.conclusions()
        assert (c["id"], c["statement"], c["status"], c["author"], c["evidence"]) == \
            ("c0001", "code-heavy mixtures lower web loss", "proposed", "tester", ["run-a", "raw-v1", "core@v2"])
    con = sqlite3.connect(path)
    assert con.execute("SELECT version FROM schema_version").fetchall() == [(C.SCHEMA_VERSION,)]
    assert con.execute("PRAGMA foreign_key_list(runs)").fetchall()  # foreign keys declared in the file itself
    con.close()


def test_a_newer_schema_version_and_a_foreign_file_are_refused_naming_the_file(tmp_path):
    path = str(tmp_path / "team.sqlite")
    C.ConclusionsDB(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE schema_version SET version = ?", (C.SCHEMA_VERSION + 1,))
    con.commit()
    con.close()
    with pytest.raises(C.ConclusionsError, match=rf"{path}: schema version {C.SCHEMA_VERSION + 1} is newer"):
        C.ConclusionsDB(path)
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE t (x)")
    con.close()
    with pytest.raises(C.ConclusionsError, match=f"{other}: a SQLite database without a conclusions schema"):
        C.ConclusionsDB(str(other))
    (tmp_path / "junk.sqlite").write_text("not a database at all")
    with pytest.raises(C.ConclusionsError, match="junk.sqlite: file is not a database"):
        C.ConclusionsDB(str(tmp_path / "junk.sqlite"))


def test_foreign_keys_are_enforced_by_sqlite_itself(db):
    _populate(db)
    with pytest.raises(C.ConclusionsError, match="FOREIGN KEY constraint failed"):
        with db._write() as conn:  # past the checks of the methods: SQLite's own constraint must refuse it
            conn.execute(C.metrics_table.insert().values(run_id="no-such-run", name="x", value=1.0))


def test_an_unknown_evidence_id_is_refused_naming_it_and_nothing_is_written(db):
    _populate(db)
    with pytest.raises(C.ConclusionsError, match="evidence 'run-zz': no such id"):
        db.add_conclusion("a claim", ["run-a", "run-zz"])
    with pytest.raises(C.ConclusionsError, match="at least one evidence id"):
        db.add_conclusion("a claim", [])
    with pytest.raises(C.ConclusionsError, match="experiment 'mix-404'"):
        db.add_conclusion("a claim", ["run-a"], experiment_id="mix-404")
    assert [c["id"] for c in db.conclusions()] == ["c0001"]


def test_re_adding_identical_content_is_a_no_op_and_conflicting_content_is_refused(db):
    _populate(db)
    args = dict(data_version="raw-v1", role="proxy", experiment_id="mix-001", workdir="/w/a", config_hash="h1",
                eval_card="core@v2", mixture=[[1, {"web": 0.25, "code": 0.75}]], flops=1.5e15, device_seconds=80.0,
                wall_s=12.5, tokens=4096)
    assert db.add_run("run-a", **args) == "run-a"  # created_at differs (now): not content
    db.add_metrics("run-a", {"heldout_loss": 3.25})
    db.add_experiment("mix-001", "mixture", {"k": 8, "alpha": 0.5}, "raw-v1", {"heldout/web": 1.0})
    db.add_eval_card("core", 2, SHA)
    assert len(db.runs()) == 1 and db.resolve("run-a")[1]["created_at"] == "2025-01-01T00:00:00+00:00"
    with pytest.raises(C.ConclusionsError, match=r"run 'run-a' already exists with other content \(flops: stored "
                                                 r"1500000000000000.0, given 2000000000000000.0\)"):
        db.add_run("run-a", **{**args, "flops": 2e15})
    with pytest.raises(C.ConclusionsError, match="metric 'heldout_loss': stored 3.25, given 3.5"):
        db.add_metrics("run-a", {"heldout_loss": 3.5})
    with pytest.raises(C.ConclusionsError, match="eval card 'core@v2' already exists with other content"):
        db.add_eval_card("core", 2, "cd" * 32)
    with pytest.raises(C.ConclusionsError, match="experiment 'mix-001' already exists.*config"):
        db.add_experiment("mix-001", "mixture", {"k": 9}, "raw-v1", {"heldout/web": 1.0})
    with pytest.raises(C.ConclusionsError, match="id 'run-a' is already a run, not an experiment"):
        db.add_experiment("run-a", "mixture")
    with pytest.raises(C.ConclusionsError, match="metric 'loss' = nan: expected a finite number"):
        db.add_metrics("run-a", {"loss": float("nan")})
    with pytest.raises(C.ConclusionsError, match="run 'run-b' role = 'Proxy': expected a lower-case word"):
        db.add_run("run-b", data_version="raw-v1", role="Proxy")
    with pytest.raises(C.ConclusionsError, match="run 'run-b': eval card 'core@v9': no such eval card"):
        db.add_run("run-b", data_version="raw-v1", eval_card="core@v9")


def test_a_run_imported_before_it_was_scored_is_linked_to_its_card_once(db):
    """link_eval_card sets a run's card when it has none, is a no-op for the same card, and refuses another card,
    an unknown run and an unknown card, naming them."""
    _populate(db)
    db.add_run("run-b", data_version="raw-v1")
    other = db.add_eval_card("core", 3, "cd" * 32)
    db.link_eval_card("run-b", other)
    db.link_eval_card("run-b", other)
    assert db.resolve("run-b")[1]["eval_card"] == "core@v3"
    with pytest.raises(C.ConclusionsError, match="run 'run-a' is linked to eval card 'core@v2', not 'core@v3'"):
        db.link_eval_card("run-a", other)
    with pytest.raises(C.ConclusionsError, match="run 'run-z': no such run"):
        db.link_eval_card("run-z", other)
    with pytest.raises(C.ConclusionsError, match="run 'run-b': eval card 'core@v9': no such eval card"):
        db.link_eval_card("run-b", "core@v9")
    assert db.resolve("run-a")[1]["eval_card"] == "core@v2"


def test_a_data_version_named_before_it_is_described_takes_its_first_description(db):
    db.add_experiment("mix-002", "mixture", {"k": 2}, data_version="raw-v2")  # not recorded yet: recorded by id
    db.add_run("run-q", data_version="raw-v2", role="validation:natural", experiment_id="mix-002")
    assert db.resolve("raw-v2") == ("data_version", {"id": "raw-v2", "path": None, "details": {}})
    db.add_data_version("raw-v2", "/corpora/raw-v2", {"documents": 7}, if_absent=True)
    assert db.resolve("raw-v2")[1] == {"id": "raw-v2", "path": "/corpora/raw-v2", "details": {"documents": 7}}
    db.add_data_version("raw-v2", "/elsewhere/raw-v2", {"documents": 7}, if_absent=True)  # kept as described
    assert db.resolve("raw-v2")[1]["path"] == "/corpora/raw-v2"
    with pytest.raises(C.ConclusionsError, match="data version 'raw-v2' already exists with other content "
                                                 r"\(path: stored '/corpora/raw-v2', given '/elsewhere/raw-v2'\)"):
        db.add_data_version("raw-v2", "/elsewhere/raw-v2", {"documents": 7})
    assert db.has("raw-v2") and db.has("run-q") and not db.has("raw-v3")
    assert [r["id"] for r in db.runs(role="validation:natural")] == ["run-q"]


def test_non_finite_numbers_in_details_are_stored_as_strings_and_read_back_as_strict_json(db, tmp_path):
    # A corpus manifest records an unset quality threshold as -inf; storing it used to fail after the first proxy
    manifest = {"stages": {"quality": {"thresholds_per_source": {"dict-gcide": float("-inf"), "web": 0.25}}},
                "nan_metric": float("nan"), "rates": (1.0, float("inf"))}
    db.add_data_version("raw-v1-clean-1", "/corpora/raw-v1", manifest)
    stored = db.resolve("raw-v1-clean-1")[1]["details"]
    assert stored == {"stages": {"quality": {"thresholds_per_source": {"dict-gcide": "-inf", "web": 0.25}}},
                      "nan_metric": "nan", "rates": [1.0, "inf"]}
    db.add_data_version("raw-v1-clean-1", "/corpora/raw-v1", manifest)  # the same content again: a no-op
    raw = sqlite3.connect(db.path).execute("SELECT details FROM data_versions").fetchone()[0]

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    assert json.loads(raw, parse_constant=refuse) == stored


def test_compare_names_what_an_id_is_when_it_is_not_a_run(db):
    cid = _populate(db)["conclusion"]
    with pytest.raises(C.ConclusionsError, match=rf"run '{cid}': no such run in \S+ \('{cid}' is a conclusion\)"):
        db.compare([cid])
    with pytest.raises(C.ConclusionsError, match=r"run 'nothing': no such run in \S+team.sqlite$"):
        db.compare(["nothing"])


def test_superseded_needs_an_existing_other_superseded_by(db):
    ids = _populate(db)
    first = ids["conclusion"]
    with pytest.raises(C.ConclusionsError, match="superseded needs superseded_by"):
        db.set_status(first, "superseded")
    with pytest.raises(C.ConclusionsError, match="superseded_by 'c0099': no such conclusion"):
        db.set_status(first, "superseded", superseded_by="c0099")
    with pytest.raises(C.ConclusionsError, match="cannot supersede itself"):
        db.set_status(first, "superseded", superseded_by=first)
    with pytest.raises(C.ConclusionsError, match="superseded_by is only for status superseded"):
        db.set_status(first, "confirmed", superseded_by=first)
    with pytest.raises(C.ConclusionsError, match="status 'maybe' is not one of"):
        db.set_status(first, "maybe")
    second = db.add_conclusion("a better statement", [first, "run-a"])
    assert second == "c0002"
    db.set_status(first, "superseded", superseded_by=second)
    assert db.resolve(first)[1]["status"] == "superseded" and db.resolve(first)[1]["superseded_by"] == second
    assert [c["id"] for c in db.conclusions("superseded")] == [first]


def test_two_writers_of_one_local_file_keep_both_rows_and_number_conclusions_apart(tmp_path):
    path = str(tmp_path / "team.sqlite")
    first, second = C.ConclusionsDB(path), C.ConclusionsDB(path)
    first.add_data_version("from-first")
    second.add_data_version("from-second")
    ids = [first.add_conclusion("one", ["from-first"]), second.add_conclusion("two", ["from-second"]),
           first.add_conclusion("three", ["from-second"])]
    first.close(), second.close()
    assert ids == ["c0001", "c0002", "c0003"]  # each new id is chosen under the write lock, seeing the other's
    with C.ConclusionsDB(path) as db:
        assert {d["id"] for d in db.data_versions()} == {"from-first", "from-second"}
        assert [c["statement"] for c in db.conclusions()] == ["one", "two", "three"]


# ------------------------------------------------------------------------------------------ a real run


@pytest.fixture(scope="module")
def tiny_run(prepared_sample, tmp_path_factory):
    """A real 3-step training run of the tiny test model on the prepared sample: its workdir."""
    from jaxpt import config as config_lib
    from jaxpt.run import session

    workdir = tmp_path_factory.mktemp("conclusions_run")
    b = tiny_bindings(prepared_sample, workdir)
    session.run_training(config_lib.parse([str(REPO_ROOT / "configs" / "quickstart.gin")], b, steps=STEPS,
                                          mesh="data=8"))
    return workdir


def _hand_flops_per_token(vocab: int) -> float:
    """Training FLOPs per token of the tiny model (conftest.tiny_bindings), written out: 6 x the matmul parameters
    (q, k, v, o, the three MLP matrices of each of the 2 layers and the output projection) + 6 x layers x heads x
    head_dim x seq_len for causal attention."""
    d, layers, heads, kv_heads, head_dim, mlp, seq = 64, 2, 4, 2, 16, 128, 64
    per_layer = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d + 3 * d * mlp
    return 6.0 * (layers * per_layer + d * vocab) + 6.0 * layers * heads * head_dim * seq


def test_import_run_takes_the_registry_id_and_computes_flops_by_the_formula(tiny_run, prepared_sample, db):
    import sentencepiece

    rec = json.loads((tiny_run / "run.json").read_text())
    imported = C.import_run(db, str(tiny_run), role="manual")
    run_id = imported["id"]
    assert run_id == rec["run_id"]
    kind, row = db.resolve(run_id)
    assert kind == "run" and imported == row
    vocab = sentencepiece.SentencePieceProcessor(model_file=str(prepared_sample / "tokenizer.model")).vocab_size()
    tokens = STEPS * 16 * 64  # steps x global_batch_size x seq_len
    assert row["tokens"] == tokens
    assert row["flops"] == pytest.approx(_hand_flops_per_token(vocab) * tokens, rel=1e-12)
    assert row["device_seconds"] == pytest.approx(rec["final"]["train_time_s"] * 8)  # 8 simulated CPU devices
    assert row["wall_s"] == pytest.approx(sum(s["goodput"]["wall_s"] for s in rec["sessions"]))
    assert (row["data_version"], row["config_hash"], row["workdir"]) == \
        (rec["data_version"], rec["config_hash"], rec["workdir"])
    assert row["metrics"] == {k: float(v) for k, v in rec["final"].items()
                              if isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert row["metrics"]["step"] == STEPS and "heldout_loss" in row["metrics"]
    assert C.import_run(db, str(tiny_run), role="manual") == row  # idempotent
    with pytest.raises(C.ConclusionsError, match=f"run '{run_id}' already exists with other content .*role"):
        C.import_run(db, str(tiny_run), role="proxy")
    with pytest.raises(C.ConclusionsError, match="experiment 'mix-404': no such experiment"):
        C.import_run(db, str(tiny_run), experiment_id="mix-404")


def test_every_id_in_a_conclusion_resolves_to_its_run_data_version_and_eval_card(tiny_run, db):
    from jaxpt.eval.card import load_card

    rec = json.loads((tiny_run / "run.json").read_text())
    db.add_experiment("mix-001", "mixture", {"k": 1})
    run_id = C.import_run(db, str(tiny_run), experiment_id="mix-001", role="proxy", eval_card=str(CARD))["id"]
    card = load_card(str(CARD), check_files=False)
    card_id = f"{card.name}@v{card.version}"
    cid = db.add_conclusion("the tiny run learns", [run_id, rec["data_version"], card_id], experiment_id="mix-001")
    _, conclusion = db.resolve(cid)
    kinds = {ref: db.resolve(ref) for ref in conclusion["evidence"]}
    assert {ref: k for ref, (k, _) in kinds.items()} == {run_id: "run", rec["data_version"]: "data_version",
                                                         card_id: "eval_card"}
    assert kinds[run_id][1]["workdir"] == rec["workdir"] and kinds[run_id][1]["eval_card"] == card_id
    assert kinds[rec["data_version"]][1]["path"].endswith("train.jsonl.gz")
    assert kinds[card_id][1]["content_sha256"] == card.content_sha256
    assert db.experiment("mix-001")["runs"] == [run_id] and db.runs(role="proxy")[0]["id"] == run_id


# ------------------------------------------------------------------------------------------ the program


def _main(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = conclusions_cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_program_lists_shows_compares_adds_and_sets_status(tmp_path, capsys, monkeypatch):
    path = str(tmp_path / "team.sqlite")
    with C.ConclusionsDB(path) as db:
        _populate(db)
        db.add_run("run-b", data_version="raw-v1", role="proxy", experiment_id="mix-001", flops=3e15, tokens=8192)
        db.add_metrics("run-b", {"heldout_loss": 3.0})
    monkeypatch.setenv(C.DB_ENV, path)  # the default when --db is not given
    rc, out, _ = _main(capsys, "list", "runs", "--experiment", "mix-001")
    assert rc == 0 and out.splitlines()[0].split()[:3] == ["id", "experiment", "role"]
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["run-a", "run-b"]
    rc, out, _ = _main(capsys, "show", "run-a", "--db", path)
    assert rc == 0 and out.startswith("run run-a\n") and "heldout_loss  3.25" in out and "c0001" in out
    rc, out, _ = _main(capsys, "compare", "run-a", "run-b", "--metric", "heldout_loss")
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert rc == 0 and lines["metric.heldout_loss"] == ["3.25", "3"] and lines["tokens"] == ["4096", "8192"]
    rc, out, _ = _main(capsys, "add-conclusion", "--statement", "run-b beats run-a", "--evidence", "run-a",
                       "--evidence", "run-b", "--experiment", "mix-001")
    assert rc == 0 and out.strip() == "c0002"
    rc, out, _ = _main(capsys, "set-status", "c0001", "superseded", "--superseded-by", "c0002")
    assert rc == 0 and out.strip() == "c0001: superseded by c0002"
    rc, out, _ = _main(capsys, "list", "conclusions", "--status", "superseded")
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [["c0001", "superseded", "c0002"]]
    rc, out, _ = _main(capsys, "show", "c0002")
    assert "evidence:" in out and "run-b  run" in out
    rc, out, _ = _main(capsys, "show", "mix-001")
    assert out.startswith("experiment mix-001") and "runs:" in out and "c0002" in out
    for what in ("experiments", "data-versions", "eval-cards"):
        assert _main(capsys, "list", what)[0] == 0


def test_the_program_refuses_with_one_line_naming_the_problem(tmp_path, capsys):
    path = str(tmp_path / "team.sqlite")
    with C.ConclusionsDB(path) as db:
        _populate(db)
    cases = [(["show", "nope"], "'nope': no such id"),
             (["add-conclusion", "--statement", "x", "--evidence", "ghost"], "evidence 'ghost': no such id"),
             (["set-status", "c0001", "superseded"], "superseded needs superseded_by"),
             (["compare", "run-a", "--metric", "mfu"], "metric 'mfu': none of runs"),
             (["list", "data-versions", "--status", "proposed"], "--status does not apply"),
             (["import-run", str(tmp_path / "no-run")], "no run")]
    for argv, message in cases:
        rc, out, err = _main(capsys, *argv, "--db", path)
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, (argv, err)


# ------------------------------------------------------------------------------------------ object storage


def test_a_gs_database_is_uploaded_after_each_write_and_reopened(gcs, tmp_path):  # noqa: F811
    from jaxpt.util import fs

    path = f"{gcs}/team/conclusions.sqlite"
    with C.ConclusionsDB(path) as db:
        assert fs.exists(path)  # the new schema was uploaded at once
        ids = _populate(db)
        local = db.local
    assert not fs.exists(local)  # the local copy went with close()
    with C.ConclusionsDB(path) as db:
        assert db.resolve(ids["conclusion"])[1]["evidence"] == ["run-a", "raw-v1", "core@v2"]
        assert db.resolve("run-a")[1]["metrics"]["heldout_loss"] == 3.25
    # the documented limit: two writers of one remote file each upload their own copy, and the last upload wins
    first, second = C.ConclusionsDB(path), C.ConclusionsDB(path)
    first.add_data_version("from-first")
    second.add_data_version("from-second")
    first.close(), second.close()
    with C.ConclusionsDB(path) as db:
        kept = {d["id"] for d in db.data_versions()}
    assert "from-second" in kept and "from-first" not in kept


def test_a_role_without_qualifier_lists_its_qualified_runs_and_db_goes_before_the_command(tmp_path, capsys):
    """``--role validation`` lists ``validation:natural`` and ``validation:proposed`` runs (not ``proxy`` nor a
    ``validationx`` role); a qualified role lists only its own; ``--db`` may come before the command."""
    path = str(tmp_path / "team.sqlite")
    with C.ConclusionsDB(path) as db:
        db.add_experiment("mix-001", "mixture")
        for rid, role in (("r1", "validation:natural"), ("r2", "validation:proposed"), ("r3", "proxy"),
                          ("r4", "validationx")):
            db.add_run(rid, data_version="raw-v1", role=role, experiment_id="mix-001")
        assert [r["id"] for r in db.runs(role="validation")] == ["r1", "r2"]
        assert [r["id"] for r in db.runs(role="validation:natural")] == ["r1"]
    rc, out, _ = _main(capsys, "--db", path, "list", "runs", "--role", "validation")
    assert rc == 0 and "r1" in out and "r2" in out and "r3" not in out and "r4" not in out
