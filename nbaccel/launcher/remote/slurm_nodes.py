"""Where the nodes of a Slurm allocation meet: each node's address, checked before anything
starts on them (``hosts="slurm"``).

Slurm names nodes (``NodeName``) and reaches each at its ``NodeAddr`` (slurm.conf; the name
itself when not set). A node name need not resolve anywhere (it often does not on clusters
whose DNS knows only addresses), but torch elastic's rendezvous binds and connects by
address: given an unresolvable name, c10d retried for minutes ("The IPv6 network addresses
of (n1, ...) cannot be retrieved") instead of failing. So the rendezvous address of each
node is the ``NodeAddr`` Slurm itself uses (``scontrol show node``, one call for all), and
every address must resolve on this machine, and have a route from it, within seconds, or
the launch fails before any ``srun`` step starts, naming the nodes, why and the fix.

Stdlib only: this runs in the kernel, which never imports torch.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence

from nbaccel.errors import ConfigError

SCONTROL_TIMEOUT = 10.0  # one scontrol call for every node: milliseconds on a live cluster
RESOLVE_TIMEOUT = 5.0  # a resolver that takes longer is as good as none for a launch

_NODE_NAME = re.compile(r"(?:^|\s)NodeName=(\S+)")
_NODE_ADDR = re.compile(r"\sNodeAddr=(\S+)")

# A host name -> its IP addresses, or OSError (getaddrinfo; tests stand another in).
Resolve = Callable[[str], list[str]]


def node_addresses(
    names: Sequence[str],
    env: Mapping[str, str],
    *,
    run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
    resolve: Resolve | None = None,
) -> list[str]:
    """The rendezvous address of each node in ``names``: its ``NodeAddr``, or its name where
    Slurm gives none (``scontrol`` missing or failing); a ConfigError when any of them does
    not resolve or has no route from here.

    >>> answer = subprocess.CompletedProcess([], 0, "NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.1"
    ...     " Port=6818\\nNodeName=n2 NodeAddr=n2 OS=Linux 6.1\\n", "")
    >>> node_addresses(["n1", "n2"], {}, run=lambda *a, **k: answer,
    ...                resolve=lambda host: ["127.0.0.1"])
    ['10.0.0.1', 'n2']
    """
    known = _scontrol_addresses(names, env, run)
    addresses = [known.get(name, name) for name in names]
    problems = _unusable(addresses, resolve or _resolve)
    if problems:
        raise ConfigError(_unusable_message(names, addresses, known, problems), field="hosts")
    return addresses


def _scontrol_addresses(
    names: Sequence[str],
    env: Mapping[str, str],
    run: Callable[..., subprocess.CompletedProcess[str]],
) -> dict[str, str]:
    """NodeName -> NodeAddr for ``names`` as slurmctld knows them; empty where it cannot say
    (then the names stand for themselves and are checked as they are)."""
    try:
        done = run(
            ["scontrol", "show", "node", "--oneliner", ",".join(names)],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT,
            env=dict(env),
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    found: dict[str, str] = {}
    for line in (done.stdout or "").splitlines() if done.returncode == 0 else ():
        name, addr = _NODE_NAME.search(line), _NODE_ADDR.search(line)
        if name and addr:
            found[name.group(1)] = addr.group(1)
    return found


def _resolve(host: str) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]


def _unusable(addresses: Sequence[str], resolve: Resolve) -> dict[str, str]:
    """address -> why it cannot serve, for each address that does not resolve within
    RESOLVE_TIMEOUT or has no route from here (all looked up at once, each in a thread that
    is left behind if its resolver hangs)."""
    problems: dict[str, str] = {}
    lock = threading.Lock()

    def check(address: str) -> None:
        try:
            why = _no_route(resolve(address))
        except OSError as error:
            why = f"it does not resolve ({error.strerror or error})"
        if why:
            with lock:
                problems[address] = why

    threads = {
        address: threading.Thread(target=check, args=(address,), daemon=True)
        for address in dict.fromkeys(addresses)
    }
    for thread in threads.values():
        thread.start()
    for address, thread in threads.items():
        thread.join(RESOLVE_TIMEOUT)  # they run at once: the whole wait is one timeout
        if thread.is_alive():
            with lock:
                problems[address] = f"resolving it took more than {RESOLVE_TIMEOUT:g} s"
    return problems


def _no_route(ips: list[str]) -> str | None:
    """None if one of ``ips`` has a route from here (a UDP socket's connect only looks the
    route up: no packet goes out); else why not."""
    error = "no address"
    for ip in ips:
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((ip, 9))
            return None
        except OSError as failed:
            error = failed.strerror or str(failed)
    return f"it resolves to {', '.join(ips) or 'nothing'}, with no route from here ({error})"


def _unusable_message(
    names: Sequence[str],
    addresses: Sequence[str],
    known: Mapping[str, str],
    problems: Mapping[str, str],
) -> str:
    lines = []
    for name, address in zip(names, addresses, strict=True):
        if address in problems:
            source = f"its NodeAddr {address}" if name in known else f"its name {name}"
            lines.append(f"- node {name}: {source}: {problems[address]}")
    return (
        'hosts="slurm" cannot start: torch elastic\'s rendezvous binds and connects at each '
        "node's address, and not every node of the allocation has one that works from "
        "here, so nothing was started:\n"
        + "\n".join(lines)
        + "\nSlurm reaches a node at its NodeAddr (`scontrol show node NAME`). Give the node "
        "a NodeAddr that resolves on every node (an IP address in slurm.conf), or make its "
        "name resolve there (DNS or /etc/hosts); `getent hosts NAME` on a node shows what "
        "it resolves to."
    )
