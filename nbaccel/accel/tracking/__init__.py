"""Experiment tracking and measurement: the trackers behind ``Accelerator.log``, the
facade's ``Tracking`` part, ``Accelerator.profile``, and the step timer (where each step's
time goes).

May import ``nested`` and the facade's ``state``.
"""
