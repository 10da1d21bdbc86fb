"""This host's IPv4 interface addresses (Linux ioctls, standard library only) and the choice of the address
a rank's zero8 communicator listens on (ZERO8_COMM_IFADDR) in a multi-node job: the one that the other
hosts reach this host by. IPv4 only, as zero8's own connections (the tcp backend, the liveness mesh) are.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

__all__ = ["local_ipv4", "pick_comm_ifaddr", "this_host_among", "default_route_iface", "default_route_ifaddr"]

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
# Linux's IPv4 routing table (reading it sends nothing anywhere).
ROUTE_FILE = "/proc/net/route"
_RTF_UP = 0x1


def local_ipv4() -> dict[str, ipaddress.IPv4Interface]:
    """{interface name: address/netmask} for every interface with an IPv4 address (the primary one)."""
    out: dict[str, ipaddress.IPv4Interface] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            req = struct.pack("256s", name.encode()[:15])
            try:
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, req)[20:24])
                mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFNETMASK, req)[20:24])
            except OSError:
                continue  # no IPv4 address on this interface
            out[name] = ipaddress.IPv4Interface(f"{addr}/{mask}")
    return out


def _resolve_ipv4(host: str) -> list[str]:
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None, socket.AF_INET)})
    except (socket.gaierror, UnicodeError):
        return []


def this_host_among(names, local_names=("localhost",)) -> str | None:
    """The first of these host names that is this machine (a name of it, or a name resolving to one of its
    addresses, loopback included), or None."""
    mine = {str(i.ip) for i in local_ipv4().values()}
    own = {socket.gethostname(), socket.getfqdn(), *local_names}
    for name in names:
        if name in own or any(a in mine or a.startswith("127.") for a in _resolve_ipv4(name)):
            return name
    return None


def _route_source(dest: str) -> str | None:
    """The source address the kernel would use to reach `dest` (a UDP connect sends no packet)."""
    addrs = _resolve_ipv4(dest)
    if not addrs:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addrs[0], 9))
            return s.getsockname()[0]
        except OSError:
            return None


def pick_comm_ifaddr(net_if: str, host: str | None, master_addr: str | None) -> tuple[str | None, str]:
    """(address, why) for ZERO8_COMM_IFADDR, or (None, why) to keep the communicator's default.
    In order: --net_if (an interface name or an IPv4 subnet: this host's address on it); the hostfile's
    name for this host when it resolves to an address of this host; the address this host uses to reach
    MASTER_ADDR (if not loopback)."""
    ifaces = local_ipv4()
    if net_if:
        if net_if in ifaces:
            return str(ifaces[net_if].ip), f"address of interface {net_if} (--net_if)"
        try:
            net = ipaddress.IPv4Network(net_if, strict=False)
        except ValueError:
            net = None
        if net is not None:
            for name, iface in ifaces.items():
                if iface.ip in net:
                    return str(iface.ip), f"address of {name} in {net} (--net_if)"
        # Fall through: the interface is not on this host; the other rules may still find one.
    mine = {str(i.ip) for i in ifaces.values()}
    if host:
        for a in _resolve_ipv4(host):
            if a in mine and not a.startswith("127."):
                return a, f"hostfile name '{host}' resolves to this host's {a}"
    if master_addr:
        src = _route_source(master_addr)
        if src and not src.startswith("127."):
            return src, f"source address of the route to MASTER_ADDR {master_addr}"
    return None, "no non-loopback address found; the communicator's default applies"


def default_route_iface(route_file: str | None = None) -> str | None:
    """The interface of the IPv4 default route (the lowest metric where there are several), from the
    kernel's routing table; None where there is none."""
    best: tuple[int, str] | None = None
    try:
        with open(route_file or ROUTE_FILE, encoding="ascii") as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split()
                if len(fields) < 8 or fields[1] != "00000000" or fields[7] != "00000000":
                    continue
                if not int(fields[3], 16) & _RTF_UP:
                    continue
                metric = int(fields[6])
                if best is None or metric < best[0]:
                    best = (metric, fields[0])
    except (OSError, ValueError):
        return None
    return best[1] if best else None


def default_route_ifaddr(route_file: str | None = None) -> tuple[str | None, str]:
    """(address, why): this host's IPv4 address on the interface of its default route, the one other hosts
    most likely reach it by when nothing names one; (None, why) where there is no such route or address."""
    iface = default_route_iface(route_file)
    if iface is None:
        return None, "this host has no IPv4 default route"
    addr = local_ipv4().get(iface)
    if addr is None or addr.ip.is_loopback:
        return None, f"the default route's interface {iface} has no IPv4 address other than loopback"
    return str(addr.ip), f"the address of {iface}, the interface of the default route"
