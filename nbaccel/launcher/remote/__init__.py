"""Several machines: which hosts and how many processes each, the check before anything
starts there (preflight), one nbaccel agent per host over SSH or ``srun`` (the kernel's
links to them, kept between launches), the agent itself, and its torch elastic workers.

May import the launch itself and ``bootstrap``; never ``local``, ``detached`` or ``xla``.
"""
