"""host:port of mpsd's metrics server (``metricsAddress``): its parser, and the strings it takes
as a JSON schema pattern (the Helm chart's schema, mpsd/config/settings.py). Pure."""

from __future__ import annotations

import ipaddress

from ..errors import ConfigError

_LABEL, _HEX = "[A-Za-z0-9][A-Za-z0-9-]{0,62}", "[0-9A-Fa-f]{1,4}"
# IPv6: the full form, or :: with at most 3 groups before it and 4 after (so never more than 7)
_IPV6 = rf"{_HEX}(:{_HEX}){{7}}|({_HEX}(:{_HEX}){{0,2}})?::({_HEX}(:{_HEX}){{0,3}})?"
_PORT = "0*([0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
# Part of what parse_address takes, never more (tests/config/test_config_schema.py)
ADDRESS_PATTERN = rf"({_LABEL}(\.{_LABEL})*|\[({_IPV6})\])?:{_PORT}"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port). IPv6 hosts in brackets (``[::1]:9400``); an empty host
    (``:9400``) means every IPv4 interface; port 0 picks a free port."""
    accepted = 'expected host:port with port 0..65535, e.g. "0.0.0.0:9400" or "[::1]:9400"'
    host, sep, port_text = address.rpartition(":")
    if not sep or not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"metricsAddress: {accepted}, got {address!r}")
    if host.startswith("[") and host.endswith("]"):
        try:
            host = str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError as e:
            raise ConfigError(f"metricsAddress: {accepted}, got {address!r} (bad IPv6 address)") from e
    elif not host:
        host = "0.0.0.0"
    elif not _is_hostname(host):
        raise ConfigError(f"metricsAddress: {accepted}, got {address!r} (bad host {host!r})")
    return host, int(port_text)


def _is_hostname(host: str) -> bool:
    """A dotted IPv4 address or a DNS name (letters, digits, '-', '.'); no bare IPv6."""
    if len(host) > 253 or not host.isascii():
        return False
    labels = host.split(".")
    return all(label and len(label) <= 63 and label.replace("-", "").isalnum() for label in labels)
