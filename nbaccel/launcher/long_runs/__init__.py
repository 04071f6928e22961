"""Runs that outlive their machine, on the kernel's side: where checkpoints go and what a
launch resumes from (``settle``), and save-and-stop on the kernel's own signals."""
