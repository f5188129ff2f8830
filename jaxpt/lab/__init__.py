"""Experiments over runs: the run registry read (``registry``), the conclusions database (``conclusions``) and the
mixture experiment by proxy runs (``mixtures``, its search ``mixture_search`` and eval-card targets
``mixture_cards``). Above ``run`` (they train and read runs), below the programs that drive them.
"""
