"""Several machines: which hosts and how many processes each, the check before anything
starts there (preflight), one nbaccel agent per host over SSH or ``srun`` (the kernel's
links to them, kept between launches), the agent itself, and its torch elastic workers.

May import the launch itself, ``bootstrap`` and ``sharing`` (an agent shares the data it
receives with its host's ranks); never ``local``, ``detached`` or ``xla``.
"""
