"""Checkpoint files: ``save_state``'s folders written atomically, DCP for sharded models
(read without running code from them), ``Accelerator.save`` and ``save_model``'s weight files.

May import ``nested``; never the facade, ``strategies`` or ``data``.
"""
