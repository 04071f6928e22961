"""Dataloaders as ``prepare`` returns them: sharded across ranks, resumable, dispatched,
skipping into an epoch, their random generators kept equal, and inputs split between
processes.

May import ``nested``, ``tracking``, ``strategies`` and the facade's ``state`` and ``optim``.
"""
