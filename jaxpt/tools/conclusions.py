"""``python -m jaxpt.tools.conclusions``: the team's conclusions database (:mod:`jaxpt.lab.conclusions`) on the
command line::

    python -m jaxpt.tools.conclusions import-run workdirs/proxy-3 --experiment mix-001 --role proxy
    python -m jaxpt.tools.conclusions list runs --experiment mix-001
    python -m jaxpt.tools.conclusions show c0001          # any id: experiment, run, data version, eval card, conclusion
    python -m jaxpt.tools.conclusions compare RUN_A RUN_B --metric heldout_loss
    python -m jaxpt.tools.conclusions add-conclusion --statement "..." --evidence RUN_A --evidence raw-v1
    python -m jaxpt.tools.conclusions set-status c0001 superseded --superseded-by c0002

The file: ``--db PATH``, else ``$JAXPT_CONCLUSIONS_DB``, else ``conclusions.sqlite`` in the current folder. Exit 2 on
a refused input, one line on stderr naming it.
"""

from __future__ import annotations

import argparse
import sys

import sqlalchemy as sa

from jaxpt.lab.conclusions import (CONCLUSION_STATUSES, DB_ENV, DEFAULT_DB, LISTS, ConclusionsDB, ConclusionsError,
                                   cmd_compare, cmd_list, cmd_show, import_run)
from jaxpt.util import cli
from jaxpt.util.errors import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m jaxpt.tools.conclusions`` (list, show, compare, add-conclusion, set-status,
    import-run; ``--db`` on each, or before the command)."""
    common = argparse.ArgumentParser(add_help=False)
    cli.add_flag(common, "--db", default=None, metavar="PATH",
                 help=f"the database file, local or gs:// (default: ${DB_ENV}, else {DEFAULT_DB} in the current "
                      "folder)")
    ap = argparse.ArgumentParser(prog="python -m jaxpt.tools.conclusions",
                                 description="The conclusions database: experiments, runs, data versions, eval cards, "
                                             "compute, metrics and conclusions (one SQLite file per team).")
    # --db before the command too (`conclusions --db F list runs`), under its own name: a subcommand's default
    # would overwrite it
    ap.add_argument("--db", dest="db_before", default=None, metavar="PATH", help="as each command's --db")
    sub = ap.add_subparsers(dest="cmd", required=True)

    def command(name: str, text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=text, description=text)

    p = command("list", "A table of one kind of row.")
    p.add_argument("what", choices=LISTS, help="which rows")
    cli.add_flag(p, "--experiment", metavar="ID", help="runs or conclusions of this experiment only")
    cli.add_flag(p, "--status", help="experiments or conclusions with this status only")
    cli.add_flag(p, "--role", help="runs with this role only (proxy, validation, manual, ...; validation also lists "
                                   "validation:<label>)")
    p = command("show", "Any id: its kind and row, a run's metrics, a conclusion's evidence, the runs and "
                        "conclusions linked to it.")
    p.add_argument("id", help="an experiment, run, data version, eval card or conclusion id")
    p = command("compare", "Runs side by side: compute and metrics, one column per run.")
    p.add_argument("runs", nargs="+", metavar="RUN_ID", help="run ids (run.json's run_id)")
    cli.add_flag(p, "--metric", action="append", metavar="NAME", help="only this metric (repeatable; default: all)")
    p = command("add-conclusion", "Record a conclusion and the ids it rests on; prints its new id.")
    cli.add_flag(p, "--statement", required=True, help="the conclusion, one sentence")
    cli.add_flag(p, "--evidence", action="append", required=True, metavar="ID",
                 help="an id it rests on: run, data version, eval card, experiment or conclusion (repeatable)")
    cli.add_flag(p, "--status", default="proposed", choices=CONCLUSION_STATUSES[:3], help="its status")
    cli.add_flag(p, "--experiment", metavar="ID", help="the experiment it concludes")
    cli.add_flag(p, "--author", help="default: the login name")
    p = command("set-status", "Confirm, refute or supersede a conclusion.")
    p.add_argument("conclusion", metavar="CONCLUSION_ID", help="the conclusion (c0001, ...)")
    p.add_argument("status", choices=CONCLUSION_STATUSES, help="its new status")
    cli.add_flag(p, "--superseded-by", metavar="ID", help="the conclusion that replaces it (status superseded)")
    p = command("import-run", "Add a completed run from its workdir (run.json and config.gin): its data version, "
                              "compute and final metrics.")
    p.add_argument("workdir", help="the run's workdir (local or gs://)")
    cli.add_flag(p, "--experiment", metavar="ID", help="the experiment the run belongs to")
    cli.add_flag(p, "--role", default="manual", help="proxy, validation, manual, ...")
    cli.add_flag(p, "--eval-card", metavar="FILE", help="the eval card (YAML) the run was evaluated with, or its id")
    return ap


def run_command(db: ConclusionsDB, args: argparse.Namespace) -> str:
    """Carry out one parsed command on ``db``; the text to print."""
    if args.cmd == "list":
        return cmd_list(db, args.what, args.experiment, args.status, args.role)
    if args.cmd == "show":
        return cmd_show(db, args.id)
    if args.cmd == "compare":
        return cmd_compare(db, args.runs, args.metric)
    if args.cmd == "add-conclusion":
        return db.add_conclusion(args.statement, args.evidence, args.status, args.experiment, args.author)
    if args.cmd == "set-status":
        db.set_status(args.conclusion, args.status, args.superseded_by)
        return f"{args.conclusion}: {args.status}" + (f" by {args.superseded_by}" if args.superseded_by else "")
    row = import_run(db, args.workdir, args.experiment, args.role, args.eval_card)
    run_id = row["id"]
    device_s = "unknown" if row["device_seconds"] is None else f"{row['device_seconds']:.4g}"
    return (f"{run_id}: {row['tokens']:,} tokens, {row['flops']:.4g} FLOPs, {device_s} device-seconds, "
            f"{len(row['metrics'])} metrics (data version {row['data_version']})")


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2: a refused input, one line on stderr naming it)."""
    args = build_parser().parse_args(argv)
    try:
        with ConclusionsDB(args.db or args.db_before) as db:
            print(run_command(db, args))
    except BrokenPipeError:  # `... | head` closed the pipe: what it wanted was printed
        sys.stderr.close()
        return 0
    except (ConclusionsError, ConfigError, FileNotFoundError, ValueError, sa.exc.SQLAlchemyError) as e:
        # input refused (exit 2, as every jaxpt program): one line naming the id, key or file
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
