"""How long ``hosts="slurm"`` takes on a real two-node Slurm cluster (issue 23, point 9).

What is measured
----------------
The tests' cluster (``tests/multihost/slurm_cluster.py``: Debian's munged, slurmctld and two
slurmd, nodes n1 at 127.0.0.2 and n2 at 127.0.0.3 of this machine, 1 CPU each):

* **cluster start**: ``serve()`` until both nodes are idle (the tests' fixture start);
* per round, a driver under ``salloc -N2 -n2`` (a fresh process that has imported nbaccel,
  as a kernel in an allocation would) times whole ``notebook_launcher`` calls of a function
  that all-reduces once over 2 ranks (gloo):

  * ``srun first``: the first launch (both agents' srun steps, probes, ``import torch``);
  * ``srun warm``: later launches on the kept agents (no step started, no host probed);
  * ``1 machine warm`` (the reference, same driver): ``notebook_launcher(f,
    num_processes=2)`` on this machine after one warm-up launch;
  * ``import torch x2 via srun`` (the floor of a first launch here): ``srun -N2 -n2
    python -c "import torch"``, until both end.

Reading the output: medians in seconds over the rounds and launches, and warm srun / warm
one machine. Both "nodes" share this machine's cores: compare ratios, rerun.

Usage::

    python benchmarks/slurm_launch.py             # 3 rounds, 3 warm launches each
    python benchmarks/slurm_launch.py --quick     # 1 round, 1 warm launch
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300.0

DRIVER = """
import json, sys, time
import nbaccel

def once():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    return dist.get_rank()

def timed(**where):
    start = time.monotonic()
    nbaccel.notebook_launcher(once, num_processes=2, use_cpu=True, runs_dir=sys.argv[1],
                              dashboard=False, **where)
    return time.monotonic() - start

warm = int(sys.argv[2])
slurm = {"hosts": "slurm", "remote_python": sys.executable}
first = timed(**slurm)
srun_warm = [timed(**slurm) for _ in range(warm)]
timed()  # the local helper's first launch
local_warm = [timed() for _ in range(warm)]
print(json.dumps({"first": first, "srun_warm": srun_warm, "local_warm": local_warm}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round, 1 warm launch")
    options = parser.parse_args()
    rounds, warm = (1, 1) if options.quick else (options.rounds, options.warm)
    sys.path.insert(0, str(REPO))  # tests/ is the repo's own, not an installed package
    from tests.multihost import slurm_cluster

    if not slurm_cluster.installed():
        print("Slurm is not installed: run .ci/install-browser", file=sys.stderr)
        return 1
    found: dict[str, list[float]] = {
        "cluster start": [],
        "import torch x2 via srun": [],
        "srun first": [],
        "srun warm": [],
        "1 machine warm": [],
    }
    with tempfile.TemporaryDirectory(prefix="nbaccel-bench-slurm-") as scratch:
        driver = Path(scratch, "driver.py")
        driver.write_text(DRIVER)
        for index in range(rounds):
            folder = Path(scratch, f"cluster{index}")
            folder.mkdir()
            print(f"round {index + 1} of {rounds}", file=sys.stderr, flush=True)
            start = time.monotonic()
            with slurm_cluster.serve(folder) as cluster:
                found["cluster start"].append(time.monotonic() - start)
                start = time.monotonic()
                cluster.run("srun", "-N2", "-n2", sys.executable, "-c", "import torch")
                found["import torch x2 via srun"].append(time.monotonic() - start)
                argv = ["salloc", "-N2", "-n2", sys.executable, str(driver), scratch, str(warm)]
                done = subprocess.run(
                    argv, env=cluster.env(), capture_output=True, text=True, timeout=TIMEOUT_S
                )
                if done.returncode:
                    print(done.stdout, done.stderr, file=sys.stderr)
                    return 1
                times = json.loads(done.stdout.strip().splitlines()[-1])
                found["srun first"].append(times["first"])
                found["srun warm"] += times["srun_warm"]
                found["1 machine warm"] += times["local_warm"]
    print('hosts="slurm", 2 nodes x 1 CPU rank (gloo), one machine; whole call, seconds:')
    for name, values in found.items():
        print(f"  {name:26} median {statistics.median(values):7.3f}  (n={len(values)})")
    ratio = statistics.median(found["srun warm"]) / statistics.median(found["1 machine warm"])
    print(f"  warm srun / warm 1 machine: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
