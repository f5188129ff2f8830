"""Command-line tools around the training core, each ``python -m jaxpt.tools.<name>``.

``plan`` (compute-optimal sizes, memory estimates), ``sweep`` (compile and time mesh shapes), ``scaling``
(small-scale scaling-law fits), ``drill`` (kill-and-resume recovery drill), ``runs`` (the run registry:
list, show, compare, plot) and ``evaluate`` (versioned evaluation reports). None of the training core
imports them.
"""
