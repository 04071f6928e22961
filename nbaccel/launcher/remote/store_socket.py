"""Where a torch.distributed store of a several-machine launch listens: on the address the
other machines reach its host by, not on every interface.

torch's ``TCPStore`` takes no address to bind: given a port it listens on every interface
(its libuv backend binds ``::``, dual-stack, else ``0.0.0.0``). It does take a socket that
already listens (``master_listen_fd``), and with ``multi_tenant=True`` the stores of one
process on one port share one server: ``TCPServer::start`` (torch/csrc/distributed/c10d/
TCPStore.cpp) keeps a weak reference to each multi-tenant server by port and hands it to
the next store asking for that port while one store still holds it. torch elastic's
rendezvous stores ask for ``multi_tenant=True`` (static_tcp_rendezvous.py's
``next_rendezvous``, c10d_rendezvous_backend.py's ``_create_tcp_store``): a store made first
on a socket from here serves theirs. The store has no authentication (docs/security.md).
Stdlib only.
"""

from __future__ import annotations

import ipaddress
import socket

BACKLOG = 128


def listen_where_reached(host: str, port: int, *, machines: int) -> socket.socket:
    """A socket listening on ``port`` (0: a free one) at the address ``host`` names on this
    machine, for a store the other machines reach as ``host``.

    On every interface instead (as torch's own store listens), where that address would
    not reach this machine from the others: ``host`` is a name that resolves to a loopback
    address here while other machines take part (Debian's /etc/hosts gives a machine's own
    name 127.0.1.1), or the address cannot be bound.

    >>> server = listen_where_reached("127.0.0.1", 0, machines=1)
    >>> server.getsockname()[0]
    '127.0.0.1'
    >>> server.close()
    >>> server = listen_where_reached("localhost", 0, machines=2)  # never this machine's
    >>> server.getsockname()[0] in ("0.0.0.0", "::")                # address to others
    True
    >>> server.close()
    """
    try:
        family, kind, proto, _, where = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        if machines > 1 and _named_loopback(host, str(where[0])):
            raise OSError(f"{host} is a loopback address here")
        server = socket.socket(family, kind, proto)
        try:
            # A port picked moments ago, or used by an earlier attempt's store: its
            # connections' TIME_WAIT must not stop the bind.
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(where)
            server.listen(BACKLOG)
        except OSError:
            server.close()
            raise
        return server
    except OSError:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("", port), family=socket.AF_INET6, backlog=BACKLOG, dualstack_ipv6=True
            )
        return socket.create_server(("", port), backlog=BACKLOG)


def _named_loopback(host: str, address: str) -> bool:
    """Whether ``host`` is a name (not an address) that resolved to a loopback address."""
    try:
        ipaddress.ip_address(host)
        return False
    except ValueError:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
