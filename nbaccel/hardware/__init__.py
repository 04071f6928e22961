"""The machine's devices as the parent sees them, without importing torch: how many GPUs and
which TPU are there (``devices``), how a launch goes through torch_xla on them (``xla_plan``),
and what a model's states take on each device under each kind of sharding
(``memory_estimate``). Plain data, the base layer: imports nothing but ``config`` and
``errors``.
"""
