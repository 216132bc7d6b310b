"""Which addresses a remote image may come from: public ones, and the operator's allowed networks."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from api.images.addresses import AddressPolicy, is_public

NOT_PUBLIC = [
    "127.0.0.1", "127.8.9.10", "10.1.2.3", "172.16.0.1", "172.31.255.255", "192.168.1.1",
    "100.64.0.1", "100.127.255.254",  # CGNAT (shared address space)
    "169.254.169.254", "169.254.0.1",  # link-local, the cloud metadata address among them
    "0.0.0.0", "0.1.2.3", "255.255.255.255", "240.0.0.1", "224.0.0.1", "239.255.255.250",
    "192.0.2.1", "198.18.0.1",  # documentation, benchmarking
    "::1", "::", "fc00::1", "fd12:3456::1", "fe80::1", "fe80::1%1", "ff02::1", "ff0e::1", "2001:db8::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::ffff:100.64.0.1",  # IPv4-mapped
    "2002:7f00:1::", "2002:a9fe:a9fe::",  # 6to4 of 127.0.0.1 and of the metadata address
    "64:ff9b::a9fe:a9fe",  # NAT64 of the metadata address
    "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
]  # fmt: skip
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.216.34", "100.128.0.1", "2606:4700:4700::1111", "::ffff:8.8.8.8",
          "2002:808:808::"]  # fmt: skip


@pytest.mark.parametrize("address", NOT_PUBLIC)
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not is_public(ip_address(address))
    assert not AddressPolicy().allows(ip_address(address))


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_are_allowed(address: str) -> None:
    assert is_public(ip_address(address))
    assert AddressPolicy().allows(ip_address(address))


def test_an_allowed_network_opens_exactly_its_addresses() -> None:
    policy = AddressPolicy([ip_network("127.0.0.1/32"), ip_network("10.5.0.0/16"), ip_network("fd00:1::/32")])
    for allowed in ("127.0.0.1", "10.5.200.1", "fd00:1::5", "::ffff:127.0.0.1", "::ffff:10.5.0.1"):
        assert policy.allows(ip_address(allowed)), allowed
    for refused in ("127.0.0.2", "10.6.0.1", "fd00:2::5", "169.254.169.254", "::1", "2002:7f00:1::"):
        assert not policy.allows(ip_address(refused)), refused


def test_the_metadata_address_stays_refused_unless_named() -> None:
    metadata = ip_address("169.254.169.254")
    assert not AddressPolicy([ip_network("10.0.0.0/8"), ip_network("::/0")]).allows(metadata)
    assert AddressPolicy([ip_network("169.254.169.254/32")]).allows(metadata)
