"""Which machines a multi-host launch runs on, and how many processes each one gets.

``hosts`` comes in three forms, all read by :func:`read_hosts`:

* a list of names, each what ``ssh`` connects to (an alias of ``~/.ssh/config``, or
  ``user@host``). No ``name:slots``: Horovod writes slots that way, but DeepSpeed's
  ``--include host:0,1`` means GPU indices there, IPv6 addresses hold colons, and ssh would
  read ``host:2222`` as a port. Slots, when wanted, come from a hostfile;
* the path of a hostfile in DeepSpeed's format (``node1 slots=4``; ``#`` comments);
* ``"slurm"``: the nodes of the Slurm allocation the kernel runs in.

:func:`processes_per_host` then splits ``num_processes`` (the total over all hosts, as in
Accelerate) between them. Stdlib only: this runs in the kernel, which never imports torch.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nbaccel.errors import ConfigError

# Slurm's own hostlist code refuses a range of more than 64K hosts; so do we (a typo such as
# node[1-100000000] must not build a list that exhausts the kernel's memory).
MAX_HOSTS = 65536

_SLOTS = re.compile(r"slots=(\d+)")
_HOST_PORT = re.compile(r"[^:\[\]]+:\d+")
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class Host:
    """One machine: ``name`` is what ``ssh`` (or ``srun --nodelist``) is given; ``slots`` is
    how many processes it may run (``None``: not said, the split is even).

    >>> Host("node1", 4)
    Host(name='node1', slots=4)
    """

    name: str
    slots: int | None = None


def read_hosts(hosts: str | Sequence[str], env: Mapping[str, str]) -> list[Host]:
    """The hosts named by a list, a hostfile's path, or ``"slurm"`` (read from ``env``).

    >>> read_hosts(["node1", "alice@node2"], {})
    [Host(name='node1', slots=None), Host(name='alice@node2', slots=None)]
    >>> env = {"SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    >>> [(h.name, h.slots) for h in read_hosts("slurm", env)]
    [('gpu01', 4), ('gpu02', 4)]
    >>> read_hosts(["node1", "node1"], {})
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: hosts names node1 twice: ...
    """
    if isinstance(hosts, str):
        found = _slurm_hosts(env) if hosts == "slurm" else _hostfile_hosts(hosts)
    else:
        found = []
        for name in hosts:
            if not isinstance(name, str):
                raise ConfigError(
                    f"hosts must be host names (strings), got {type(name).__name__} {name!r}. "
                    'Write hosts=["node1", "node2"].',
                    field="hosts",
                )
            _check_name(name, "hosts")
            found.append(Host(name))
    if not found:
        raise ConfigError(
            f"hosts={hosts!r} names no host, so there is nowhere to start processes. Name at "
            'least one: hosts=["node1", "node2"], a hostfile, or "slurm".',
            field="hosts",
        )
    _check_unique(found, hosts)
    return found


def processes_per_host(hosts: Sequence[Host], num_processes: int | None) -> list[int]:
    """How many processes each host starts; ``num_processes`` is the total over all hosts.

    With slots on every host, processes fill the hosts in order up to their slots (``None``
    uses every slot); a host may be left with 0, and then starts nothing. Without slots, the
    total is split evenly and must divide by the number of hosts.

    >>> processes_per_host([Host("a", 4), Host("b", 2)], None)
    [4, 2]
    >>> processes_per_host([Host("a", 4), Host("b", 4)], 6)
    [4, 2]
    >>> processes_per_host([Host("a"), Host("b")], 8)
    [4, 4]
    >>> processes_per_host([Host("a"), Host("b")], 7)
    Traceback (most recent call last):
    ...
    nbaccel.errors.ConfigError: num_processes=7 cannot be split evenly over 2 hosts ...
    """
    if not hosts:
        raise ConfigError("processes_per_host needs at least one host.", field="hosts")
    if num_processes is not None and num_processes < 1:
        raise ConfigError(
            f"num_processes must be >= 1, got {num_processes}. It is the total number of "
            "processes over all hosts.",
            field="num_processes",
        )
    without = [h.name for h in hosts if h.slots is None]
    if without and len(without) < len(hosts):
        raise ConfigError(
            f"Some hosts have slots and {_names(without)} have none, so nbaccel cannot tell how "
            "many processes those should run. Give every host a slots= count in the hostfile, "
            "or none (then num_processes is split evenly).",
            field="hosts",
        )
    if not without:
        return _fill_slots(hosts, num_processes)
    count = len(hosts)
    if num_processes is None:
        raise ConfigError(
            f"num_processes is needed: the {count} hosts have no slots to count processes "
            f"from. Give the total over all hosts, e.g. num_processes={count * 2} for 2 per "
            "host, or give slots in a hostfile (node1 slots=4).",
            field="num_processes",
        )
    if num_processes % count:
        below = num_processes - num_processes % count
        above = below + count
        nearest = [below, above] if below else [above, above + count]
        raise ConfigError(
            f"num_processes={num_processes} cannot be split evenly over {count} hosts "
            f"({_names([h.name for h in hosts])}): num_processes is the total over all hosts "
            f"and every host runs the same number. Use num_processes={nearest[0]} or "
            f"{nearest[1]}, or give each host its slots in a hostfile (node1 slots=3).",
            field="num_processes",
        )
    return [num_processes // count] * count


def expand_hostlist(text: str) -> list[str]:
    """Expand Slurm's compressed host list (``SLURM_JOB_NODELIST``), in Slurm's order.

    A bracket holds numbers and ranges; each number keeps the width of the range's first one
    (``[08-10]`` gives 08 09 10). Several brackets in a name expand the earlier one outermost,
    as Slurm's hostlist does for ``rack[1-2]-n[1-2]``. Text after the last bracket, which
    Slurm itself never writes, is kept as a suffix.

    >>> expand_hostlist("node[01-03,7],gpu2")
    ['node01', 'node02', 'node03', 'node7', 'gpu2']
    >>> expand_hostlist("rack[1-2]-n[1-2]")
    ['rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    names: list[str] = []
    for token in _split_outside_brackets(text):
        literals = _GROUP.split(token)  # literal, group, literal, group, ..., literal
        if any("[" in part or "]" in part for part in literals[::2]):
            raise ValueError(f"unbalanced bracket in {token!r}")
        choices: list[list[str]] = []
        for index, part in enumerate(literals):
            choices.append(_expand_group(part, token) if index % 2 else [part])
        total = 1
        for options in choices:
            total *= len(options)
        if len(names) + total > MAX_HOSTS:
            raise ValueError(f"{token!r} names more than {MAX_HOSTS} hosts")
        names.extend("".join(parts) for parts in itertools.product(*choices))
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``: 2 on three nodes, then 1).

    >>> expand_tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts: list[int] = []
    for item in text.split(","):
        match = _TASKS.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"{item!r} is neither N nor N(xK)")
        repeat = int(match.group(2) or 1)
        if len(counts) + repeat > MAX_HOSTS:
            raise ValueError(f"{text!r} counts more than {MAX_HOSTS} nodes")
        counts.extend([int(match.group(1))] * repeat)
    return counts


def _split_outside_brackets(text: str) -> list[str]:
    # Slurm separates names with commas (and accepts blanks); a comma inside [...] is part of
    # the range list.
    tokens: list[str] = []
    current: list[str] = []
    depth = 0
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"']' without '[' in {text!r}")
        if depth == 0 and (char == "," or char.isspace()):
            tokens.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"'[' without ']' in {text!r}")
    tokens.append("".join(current))
    return [t for t in tokens if t]


def _expand_group(content: str, token: str) -> list[str]:
    numbers: list[str] = []
    for item in content.split(","):
        match = _RANGE.fullmatch(item.strip())
        if match is None:
            raise ValueError(f"[{content}] in {token!r}: {item!r} is not a number or a range")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(low) > int(high):
            raise ValueError(f"[{content}] in {token!r}: the range {item!r} runs backwards")
        if len(numbers) + int(high) - int(low) + 1 > MAX_HOSTS:
            raise ValueError(f"[{content}] in {token!r} names more than {MAX_HOSTS} hosts")
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers


def _slurm_hosts(env: Mapping[str, str]) -> list[Host]:
    variable = "SLURM_JOB_NODELIST" if "SLURM_JOB_NODELIST" in env else "SLURM_NODELIST"
    nodelist = env.get(variable)
    if not nodelist:
        raise ConfigError(
            'hosts="slurm" takes the nodes of the Slurm allocation this kernel runs in, but '
            "there is none: SLURM_JOB_NODELIST is not set. Start Jupyter inside an allocation "
            "(salloc --nodes=2 ..., then jupyter lab; or from an sbatch script), or name the "
            'hosts: hosts=["node1", "node2"] or a hostfile.',
            field="hosts",
        )
    try:
        names = expand_hostlist(nodelist)
    except ValueError as error:
        raise ConfigError(
            f"{variable}={nodelist!r} cannot be read as a Slurm host list: {error}. nbaccel "
            'reads names such as node[01-03,7],gpu2. Name the hosts instead: hosts=["node1", '
            '"node2"] or a hostfile.',
            field="hosts",
        ) from None
    for name in names:
        _check_name(name, variable)
    tasks = env.get("SLURM_TASKS_PER_NODE")
    if not tasks:
        return [Host(name) for name in names]
    try:
        slots = expand_tasks_per_node(tasks)
    except ValueError as error:
        raise ConfigError(
            f"SLURM_TASKS_PER_NODE={tasks!r} cannot be read: {error}. Slurm writes it as "
            "2(x3),1. Unset it to split num_processes evenly over the nodes.",
            field="hosts",
        ) from None
    if len(slots) != len(names):
        raise ConfigError(
            f"SLURM_TASKS_PER_NODE={tasks!r} counts {len(slots)} nodes but {variable}="
            f"{nodelist!r} names {len(names)}, so the slots of each node are unknown. Unset "
            "SLURM_TASKS_PER_NODE to split num_processes evenly over the nodes.",
            field="hosts",
        )
    return [Host(name, count) for name, count in zip(names, slots, strict=True)]


def _hostfile_hosts(path_text: str) -> list[Host]:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"hosts={path_text!r} is neither a hostfile (no file {str(path)!r}) nor "
            '"slurm". For one host write a list: hosts=["' + path_text + '"]; for a '
            "hostfile give its path (lines such as `node1 slots=4`).",
            field="hosts",
        )
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"The hostfile {str(path)!r} cannot be read: {error}. Check its permissions, or "
            "name the hosts in a list.",
            field="hosts",
        ) from None
    found: list[Host] = []
    for number, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        name, *rest = text.split()
        slots = _SLOTS.fullmatch(rest[0]) if len(rest) == 1 else None
        if rest and (slots is None or int(slots.group(1)) < 1):
            raise ConfigError(
                f"{path}, line {number}: cannot read {line.strip()!r}. A hostfile line is a "
                "host name, optionally followed by slots=N (N >= 1), as in DeepSpeed's "
                "hostfiles: `node1 slots=4`; `#` starts a comment.",
                field="hosts",
            )
        _check_name(name, f"{path}, line {number}")
        found.append(Host(name, int(slots.group(1)) if slots else None))
    return found


def _check_name(name: str, where: str) -> None:
    if not name or any(c.isspace() or not c.isprintable() for c in name):
        problem = "is empty" if not name else "holds a blank or a control character"
    elif name.startswith("-"):
        problem = "starts with '-', which ssh and srun would read as an option"
    elif _HOST_PORT.fullmatch(name):
        raise ConfigError(
            f"{where}: {name!r} looks like host:port or host:slots, which nbaccel does not "
            "read: ssh takes no port in the name. Give the port with ssh_options=('-p', "
            "'2222') or a Host entry in ~/.ssh/config, and slots in a hostfile "
            "(`node1 slots=4`).",
            field="hosts",
        )
    else:
        return
    raise ConfigError(
        f"{where}: the host name {name!r} {problem}. A host is what `ssh NAME` connects to: "
        "a name, an address, an alias of ~/.ssh/config or user@host.",
        field="hosts",
    )


def _check_unique(found: list[Host], hosts: str | Sequence[str]) -> None:
    seen: set[str] = set()
    for host in found:
        if host.name in seen:
            source = f" (from {hosts!r})" if isinstance(hosts, str) else ""
            raise ConfigError(
                f"hosts names {host.name} twice{source}: each host runs one nbaccel agent, "
                "which starts all of that host's processes. Name it once; to run more "
                "processes there, give it more slots in a hostfile (`node1 slots=8`).",
                field="hosts",
            )
        seen.add(host.name)


def _fill_slots(hosts: Sequence[Host], num_processes: int | None) -> list[int]:
    slots = [h.slots or 0 for h in hosts]
    total = sum(slots)
    if num_processes is None:
        return slots
    if num_processes > total:
        raise ConfigError(
            f"The slots add up to {total} but num_processes={num_processes} (the total over "
            f"all hosts: {', '.join(f'{h.name}={h.slots}' for h in hosts)}). Use "
            f"num_processes <= {total} (or leave it out to use every slot), or give the hosts "
            "more slots (a hostfile's slots=, Slurm's --ntasks-per-node).",
            field="num_processes",
        )
    counts: list[int] = []
    left = num_processes
    for count in slots:
        counts.append(min(count, left))
        left -= counts[-1]
    return counts


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
