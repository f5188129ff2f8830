"""Experiments over runs: the planner's numbers (``plan``: compute-optimal sizes, memory, checkpoint interval), the
scaling grid and its fit (``scaling``), the learning-rate/batch rules (``rules``), the run registry read
(``registry``), the conclusions database (``conclusions``) and the mixture experiment by proxy runs (``mixtures``, its
search ``mixture_search`` and eval-card targets ``mixture_cards``). Above ``run`` (they train, validate and read
runs), below the programs that drive them.
"""
