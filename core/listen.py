"""``HOST:PORT`` addresses to listen on, parsed by one set of rules for every component.

Rules: an IPv6 host goes in brackets (``[::1]:9450``) and must be a valid IPv6 address; a host with
a colon outside brackets is refused rather than guessed at; an empty host (``:9450``) means
`default_host`; the port is 1 to 65535 written in ASCII digits, or 0 (the system picks one) where the
caller allows it. A value that breaks a rule raises ValueError saying which one.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

_PORT = re.compile(r"[0-9]{1,5}")
_HOST_FORBIDDEN = re.compile(r"[\s/\[\]@]")


class HostPort(NamedTuple):
    """A parsed listen address: the host (IPv6 without its brackets) and the port."""

    host: str
    port: int


def parse_host_port(value: str, default_host: str = "0.0.0.0", allow_port_zero: bool = False) -> HostPort:
    """`value` (``HOST:PORT`` or ``[IPV6]:PORT``) into its host and port; ValueError when it is not one."""
    if not isinstance(value, str):
        raise ValueError(f"expected HOST:PORT as text, got {type(value).__name__}")
    host, sep, port = value.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {value!r} (no port)")
    host = _host(host, value) or default_host
    lowest = 0 if allow_port_zero else 1
    if not _PORT.fullmatch(port) or not lowest <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port from {lowest} to 65535, got {value!r}")
    return HostPort(host, int(port))


def _host(host: str, value: str) -> str:
    """The host part without brackets, checked: brackets only around an IPv6 address."""
    if host.startswith("[") or host.endswith("]"):
        inner = host[1:-1]
        if not (host.startswith("[") and host.endswith("]")) or not inner:
            raise ValueError(f"expected [IPV6]:PORT, got {value!r} (unbalanced or empty brackets)")
        try:
            ipaddress.IPv6Address(inner)
        except ValueError:
            raise ValueError(f"expected an IPv6 address in brackets, got {value!r}") from None
        return inner
    if _HOST_FORBIDDEN.search(host):
        raise ValueError(f"expected a host name or address before the port, got {value!r}")
    if ":" in host:
        raise ValueError(f"an IPv6 host goes in brackets ([::1]:PORT), got {value!r}")
    return host
