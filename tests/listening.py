"""Which addresses a process listens on (TCP), read from /proc: the test of "binds only
configured interfaces"."""

from __future__ import annotations

import ipaddress
import os


def _socket_inodes(pid: int | str) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def _address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc/net/tcp{,6} write each 32-bit word in host (little-endian) order
    ip = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # gRPC binds an IPv4 address as ::ffff:a.b.c.d
    return ("0.0.0.0" if str(addr) == "::" else str(addr)), int(port_hex, 16)  # "::": every interface too


def listening(pid: int | str = "self") -> list[tuple[str, int]]:
    """(ip, port) of every TCP socket the process has in LISTEN state."""
    inodes = _socket_inodes(pid)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                out.append(_address(fields[1]))
    return out
