"""Accelerate's per-node form, unchanged: the same cell in two kernels forms one job.

Each kernel stands for a machine: it runs ``notebook_launcher(..., num_processes=2,
num_nodes=2, node_rank=R, master_addr=..., use_port=...)`` as in Accelerate, where
``num_processes`` counts one machine's processes. The two kernels' agents meet in torch
elastic's static rendezvous, served by machine 0's; the four ranks all-reduce across both,
each cell shows its own machine's ranks only, and every cell returns rank 0's value.
"""

from __future__ import annotations

import json
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from tests.notebook.conftest import cell_output

KERNEL_NAME = "python3"

CELL = """
import nbaccel


def train(tag):
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"rank {{rank}} of {{world}}: sum {{total.item():g}}")
    return {{"rank": rank, "world": world, "sum": total.item(), "tag": tag}}


RESULT = nbaccel.notebook_launcher(
    train,
    args=("from rank 0",),
    num_processes=2,
    num_nodes=2,
    node_rank={node_rank},
    master_addr="127.0.0.1",
    use_port="{port}",
    runs_dir={runs!r},
    dashboard=False,
    log_ranks="all",
)
print("RESULT", RESULT)
"""


@pytest.fixture
def kernels(kernel_dirs: Path, tmp_path: Path) -> Iterator[list[BlockingKernelClient]]:
    managers, clients = [], []
    try:
        for machine in range(2):
            km = KernelManager(kernel_name=KERNEL_NAME)
            folder = tmp_path / f"machine{machine}"
            folder.mkdir()
            km.start_kernel(cwd=str(folder))
            managers.append(km)
            kc = km.client()
            kc.start_channels()
            clients.append(kc)
        for kc in clients:
            kc.wait_for_ready(timeout=120)
        yield clients
    finally:
        for kc in clients:
            kc.stop_channels()
        for km in managers:
            km.shutdown_kernel(now=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _run_to_idle(kc: BlockingKernelClient, msg_id: str, deadline: float) -> tuple[str, list[str]]:
    """The cell's stream text and error names, read until the kernel is idle after it."""
    text, errors, idle = cell_output(kc, msg_id, deadline)
    if not idle:
        pytest.fail(f"the cell did not finish in time; so far:\n{text}")
    return text, [f"{error['ename']}: {error['evalue']}" for error in errors]


@pytest.mark.timeout(400)
def test_the_same_cell_in_two_kernels_forms_one_job(
    kernels: list[BlockingKernelClient], tmp_path: Path
) -> None:
    port = _free_port()
    runs = [tmp_path / f"runs{machine}" for machine in range(2)]
    # Both cells run at once, as on two machines; machine 1's cell is sent first.
    sent = {
        machine: kernels[machine].execute(
            textwrap.dedent(CELL).format(node_rank=machine, port=port, runs=str(runs[machine])),
            stop_on_error=False,
        )
        for machine in (1, 0)
    }
    deadline = time.monotonic() + 300
    outputs = {m: _run_to_idle(kernels[m], sent[m], deadline) for m in (0, 1)}
    expected = {"rank": 0, "world": 4, "sum": 10.0, "tag": "from rank 0"}
    for machine, (text, errors) in outputs.items():
        assert not errors, f"machine {machine}: {errors}\n{text}"
        # Rank 0's value, on every machine (it reached machine 1 through the job's store).
        assert f"RESULT {expected}" in text, text
        ours = {2 * machine, 2 * machine + 1}
        for rank in range(4):
            line = f"rank {rank} of 4: sum 10"
            assert (line in text) == (rank in ours), f"machine {machine}, rank {rank}:\n{text}"
    # Each kernel's run folder: its own ranks' logs, and the schema's fields with their source.
    for machine, folder in enumerate(runs):
        [run_dir] = [p.parent for p in folder.glob("*/config.json")]  # the run, not caches
        logs = sorted(p.name for p in run_dir.glob("rank*.log"))
        assert logs == [f"rank{2 * machine}.log", f"rank{2 * machine + 1}.log"], logs
        record = json.loads((run_dir / "config.json").read_text())
        values, sources = record["config"], record["sources"]
        assert values["num_machines"] == 2 and values["machine_rank"] == machine, values
        assert values["num_processes"] == 4, values  # 2 per node: 4 in all, as Accelerate
        assert values["main_process_port"] == port, values
        assert sources["machine_rank"] == "argument", sources
