"""Runs that outlive their machine, on the worker side: periodic saves at a step every rank
agrees on, written in the background; save-and-stop on a signal; the resume from the
checkpoint the launch chose (``resume``). ``AutoSave`` is what the Accelerator holds."""
