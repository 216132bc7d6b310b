"""Which addresses a remote image may be fetched from: public ones, and those inside the
networks the operator allowed (an internal image host). Everything else is refused, so that an
image URL cannot make the API reach loopback, private networks or a cloud metadata service."""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

Address = IPv4Address | IPv6Address
Network = IPv4Network | IPv6Network


def is_public(address: Address) -> bool:
    """Global unicast, by the IANA special-purpose registries Python's ``ipaddress`` follows: not
    loopback, private (RFC 1918, ULA fc00::/7), shared (CGNAT 100.64/10), link-local (169.254/16,
    including the 169.254.169.254 metadata address; fe80::/10), unspecified, documentation,
    reserved or multicast. IPv6 forms that carry an IPv4 address are judged by that address too."""
    return all(form.is_global and not form.is_multicast and not form.is_reserved for form in _forms(address))


def _forms(address: Address) -> list[Address]:
    if isinstance(address, IPv4Address):
        return [address]
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]  # the same host as its IPv4 address
    # 6to4 and Teredo reach the IPv4 address they embed: both must be public.
    embedded = [address.sixtofour, *(address.teredo or ())]
    return [address, *(form for form in embedded if form is not None)]


class AddressPolicy:
    """Public addresses, and any inside ``allowed_networks`` (an IPv4-mapped IPv6 address counts
    as its IPv4 address)."""

    def __init__(self, allowed_networks: Sequence[Network] = ()) -> None:
        self._allowed = tuple(allowed_networks)

    def allows(self, address: Address) -> bool:
        return is_public(address) or self.is_allowlisted(address)

    def is_allowlisted(self, address: Address) -> bool:
        forms: list[Address] = [address]
        if isinstance(address, IPv6Address) and address.ipv4_mapped is not None:
            forms.append(address.ipv4_mapped)
        return any(form in network for form in forms for network in self._allowed)
