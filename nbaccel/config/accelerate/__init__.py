"""Hugging Face Accelerate's faces of the config: its YAML and environment variables, its
enums, dataclasses, kwargs handlers and plugins, and its ``notebook_launcher`` keywords, all
mapped onto nbaccel's one schema.

May import the schema (``schema``, ``sections``); nothing else of ``nbaccel.config``.
"""
