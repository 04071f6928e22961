"""``accelerate.utils.write_basic_config``: a default config file for this machine. Torch-free.

It writes what ``accelerate config default`` writes, where Accelerate keeps it
(``$HF_HOME/accelerate/default_config.yaml``, else under ``$XDG_CACHE_HOME`` or ``~/.cache``),
so both tools read the same file: ``accelerate launch`` directly, and nbaccel's ``resolve``
through its reader of Accelerate's schema (``nbaccel.config.accelerate.compat``) when there is
no nbaccel default file. The content is Accelerate's: JSON (which YAML readers take too), one
process per visible GPU and ``MULTI_GPU`` with more than one, else one CPU process.

GPUs are counted without importing torch or creating a CUDA context
(``nbaccel.hardware.devices.visible_gpu_count``: NVML, or the driver's ``/proc`` entries), so a
notebook kernel can call it before launching. Accelerate also counts Intel, Ascend and other
accelerators; nbaccel trains on CUDA GPUs, TPUs (whose launch needs no file) and CPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from nbaccel.config.files import accelerate_default_file
from nbaccel.hardware.devices import visible_gpu_count

__all__ = ["write_basic_config"]

_PRECISIONS = ("no", "fp16", "bf16")


def write_basic_config(
    mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None
) -> Path | bool:
    """Write Accelerate's basic config to ``save_location`` (default: Accelerate's default
    file) and return its path; if the file exists, leave it, say so and return ``False``.

    >>> import json, tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "default_config.yaml"
    >>> write_basic_config("bf16", save_location=path) == path
    True
    >>> json.loads(path.read_text())["mixed_precision"]
    'bf16'
    >>> write_basic_config(save_location=path)  # doctest: +ELLIPSIS
    Configuration already exists at ..., will not override. ...
    False
    """
    path = Path(save_location) if save_location is not None else _default_location()
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        # Accelerate's behaviour and words: an existing config is the user's, never replaced.
        print(
            f"Configuration already exists at {path}, will not override. Run `accelerate "
            "config` (or `nbaccel config`) manually or pass a different `save_location`."
        )
        return False
    precision = str(getattr(mixed_precision, "value", mixed_precision)).lower()
    if precision == "fp8":
        from nbaccel.config.accelerate.enums import PrecisionType

        raise NotImplementedError(
            f"write_basic_config(mixed_precision={PrecisionType.FP8.value!r}): fp8 training "
            "(TransformerEngine, MS-AMP, torchao) is outside nbaccel's scope, which trains in "
            "fp32, bf16 or fp16, so nbaccel would refuse the file it wrote. Use 'bf16' or 'fp16'."
        )
    if precision not in _PRECISIONS:
        raise ValueError(
            f"write_basic_config(mixed_precision={mixed_precision!r}): it should be one of "
            f"{', '.join(map(repr, _PRECISIONS))}."
        )
    path.write_text(json.dumps(basic_config(precision), indent=2, sort_keys=True) + "\n")
    return path


def basic_config(mixed_precision: str, gpus: int | None = None) -> dict[str, object]:
    """What ``write_basic_config`` writes, for ``gpus`` visible GPUs (default: counted).

    >>> config = basic_config("no", gpus=4)
    >>> config["distributed_type"], config["num_processes"], config["use_cpu"]
    ('MULTI_GPU', 4, False)
    >>> basic_config("no", gpus=0)["distributed_type"]
    'NO'
    """
    gpus = visible_gpu_count(os.environ) if gpus is None else gpus
    # The keys and values Accelerate's ClusterConfig writes with its defaults (1.x).
    return {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
        "downcast_bf16": False,
        "enable_cpu_affinity": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": mixed_precision,
        "num_machines": 1,
        "num_processes": gpus if gpus else 1,
        "rdzv_backend": "static",
        "same_network": False,
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
        "use_cpu": not gpus,
    }


def _default_location() -> Path:
    # Read, never written: Accelerate's own default honours HF_HOME / XDG_CACHE_HOME too.
    return accelerate_default_file(os.environ)
