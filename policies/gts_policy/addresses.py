"""How much of the internet a set of source CIDRs opens.

A rule is judged by the address space it opens, not by its spelling: `0.0.0.0/1` plus
`128.0.0.0/1` is the whole internet as surely as `0.0.0.0/0`. A set of CIDRs "opens the
internet" when, merged, it covers more public addresses than one /8 (IPv4) or one /32 (IPv6):
no office, VPN or CI runner range is that large.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

IPV4_LIMIT = 2 ** (32 - 8)
IPV6_LIMIT = 2 ** (128 - 32)
Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(cidrs: Iterable[str | Net]) -> list[Net]:
    """CIDR strings as networks (host bits are ignored, as cloud APIs do)."""
    return [c if isinstance(c, (ipaddress.IPv4Network, ipaddress.IPv6Network))
            else ipaddress.ip_network(str(c), strict=False) for c in cidrs]


def public_span(cidrs: Iterable[str | Net]) -> tuple[int, int]:
    """(IPv4, IPv6) count of addresses the merged set covers, private ranges excluded."""
    nets = parse_networks(cidrs)
    v4 = list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv4Network)))
    v6 = list(ipaddress.collapse_addresses(n for n in nets if isinstance(n, ipaddress.IPv6Network)))
    return (sum(n.num_addresses for n in v4 if not n.is_private),
            sum(n.num_addresses for n in v6 if not n.is_private))


def opens_internet(cidrs: Iterable[str | Net]) -> bool:
    """Whether these sources, taken together, are the internet rather than a few known ranges."""
    nets = parse_networks(cidrs)
    if any(n.prefixlen == 0 for n in nets):
        return True
    v4, v6 = public_span(nets)
    return v4 > IPV4_LIMIT or v6 > IPV6_LIMIT
