"""One parser of HOST:PORT listen addresses (megatrace.listen) for the node agent and the alert bot."""

from __future__ import annotations

import pytest

from megatrace.config import ConfigError
from megatrace.exporters.settings import load
from megatrace.listen import parse_host_port


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0.0.0.0:9450", ("0.0.0.0", 9450)),
        ("127.0.0.1:1", ("127.0.0.1", 1)),
        ("node-a.svc.cluster.local:65535", ("node-a.svc.cluster.local", 65535)),
        ("[::1]:9450", ("::1", 9450)),
        ("[::]:80", ("::", 80)),
        ("[fe80::1%eth0]:9450", ("fe80::1%eth0", 9450)),
        (":9450", ("0.0.0.0", 9450)),
    ],
)
def test_addresses_parse(value: str, expected: tuple[str, int]) -> None:
    assert parse_host_port(value) == expected


def test_the_empty_host_takes_the_callers_default() -> None:
    assert parse_host_port(":8080", default_host="127.0.0.1") == ("127.0.0.1", 8080)


def test_port_zero_only_where_the_caller_allows_it() -> None:
    with pytest.raises(ValueError, match="port from 1 to 65535"):
        parse_host_port("127.0.0.1:0")
    assert parse_host_port("127.0.0.1:0", allow_port_zero=True) == ("127.0.0.1", 0)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("9450", "no port"),
        ("", "no port"),
        ("host:", "port from 1 to 65535"),
        ("host:65536", "port from 1 to 65535"),
        ("host:-1", "port from 1 to 65535"),
        ("host:+80", "port from 1 to 65535"),
        ("host:٩٤٥٠", "port from 1 to 65535"),
        ("host:9450 ", "port from 1 to 65535"),
        ("::1:9450", "goes in brackets"),
        ("[::1:9450", "unbalanced or empty brackets"),
        ("::1]:9450", "unbalanced or empty brackets"),
        ("[]:9450", "unbalanced or empty brackets"),
        ("[node-a]:9450", "IPv6 address in brackets"),
        ("no such host:80", "host name or address"),
        ("http://host:80", "host name or address"),
        ("user@host:80", "host name or address"),
    ],
)
def test_bad_addresses_say_why(value: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_host_port(value)


def test_not_text_is_refused() -> None:
    with pytest.raises(ValueError, match="as text, got int"):
        parse_host_port(9450)  # type: ignore[arg-type]


def test_the_agent_refuses_an_unbracketed_ipv6_listen_address() -> None:
    with pytest.raises(ConfigError, match="key 'listen': an IPv6 host goes in brackets"):
        load(None, {"listen": "::1:9450"}, environ={})
    with pytest.raises(ConfigError, match="key 'trace_listen': expected an IPv6 address in brackets"):
        load(None, {"trace_listen": "[node-a]:9452"}, environ={})
    assert (
        load(None, {"trace_listen": "[::1]:9452"}, environ={}).settings("traces").trace_listen == "[::1]:9452"
    )
