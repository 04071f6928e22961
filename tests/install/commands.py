"""What the install tests share: a command run to its end, its failure shown whole."""

from __future__ import annotations

import subprocess
from pathlib import Path


def run(command: list[str | Path], cwd: Path, timeout: float = 300) -> str:
    """``command``'s stdout; an assertion with both outputs if it exits non-zero."""
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, cwd=cwd, timeout=timeout
    )
    assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
    return result.stdout
