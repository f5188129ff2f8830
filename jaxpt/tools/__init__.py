"""The programs: every ``python -m`` entry point but ``jaxpt.train``, each ``python -m jaxpt.tools.<name>``.

``plan`` (compute-optimal sizes, memory estimates), ``compile`` (compile the train step for a target slice),
``sweep`` (compile and time mesh shapes), ``scaling`` (small-scale scaling-law fits), ``gate`` (judge a small run
before scaling up), ``drill`` (kill-and-resume recovery drill), ``runs`` (the run registry: list, show, compare,
plot), ``evaluate`` (held-out figures, eval cards, extrapolation, comparisons), ``convert`` (Hugging Face models in
and out), ``diagnose`` (spike diagnosis). Nothing in the library imports them.
"""

from __future__ import annotations

import runpy
import sys


def run_moved(old: str, new: str, *subcommand: str) -> None:
    """Run program ``new`` as ``python -m new [subcommand...] ARGS`` would (``ARGS``: this process's arguments),
    after telling the user that ``python -m old`` moved there (the old name keeps working for one release). Exits
    with the program's status."""
    target = " ".join([new, *subcommand])
    print(f"note: `python -m {old}` is now `python -m {target}`; the old name goes in the next release",
          file=sys.stderr)
    sys.argv[:1] = [new, *subcommand]
    runpy.run_module(new, run_name="__main__", alter_sys=True)
