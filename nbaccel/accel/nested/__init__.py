"""Nested tensors (dicts, lists and tuples of tensors): ``tree_map``, the collectives over
them (gather, reduce, pad), and collated batches moved to a device, measured and sliced.

The lowest room of the worker side: imports nothing of ``nbaccel.accel``.
"""
