"""DeepSpeed's config: the dict nbaccel generates from the schema (or reads from a file),
its checks, and the ``"auto"`` placeholders filled once the model is known.

May import the schema (``schema``, ``sections``); nothing else of ``nbaccel.config``.
"""
