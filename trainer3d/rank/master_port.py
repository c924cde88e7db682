"""The port rank 0 serves torch.distributed's store on (``MASTER_PORT``).

submitit's ``TorchDistributedEnvironment`` draws it from the job id, anywhere in 20000-60000.
Most of that range is Linux's ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999
by default): the kernel hands those ports to every outgoing connection and to every listener
bound to port 0, gloo's pair sockets among them. On a host busy with other jobs rank 0 then
finds its port taken and the job fails at start-up (``DistNetworkError ... EADDRINUSE``).

- A local job (every rank on this host): the submitting process picks a port outside the
  ephemeral range that nothing listens on, and hands it to the ranks in their environment.
- A Slurm job (ranks on several hosts, no process to choose for all of them): the port is
  derived from the job id, as submitit does, but below the default ephemeral range.

A ``MASTER_PORT`` the user set is kept in both cases.
"""

import errno
import random
import socket
import zlib
from typing import Optional, Tuple

LOWEST = 20000
"""The lowest port chosen: above the well-known and registered services most hosts run."""
DEFAULT_EPHEMERAL = (32768, 60999)
"""Linux's default ``net.ipv4.ip_local_port_range``."""


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> Tuple[int, int]:
    """This host's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        with open(path) as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def _candidates(ephemeral: Tuple[int, int]) -> Tuple[range, ...]:
    low, high = ephemeral
    ranges = (range(LOWEST, min(low, 65536)), range(max(high + 1, LOWEST), 65536))
    return tuple(r for r in ranges if len(r) > 0)


def is_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on every IPv4 and IPv6 address now (as the
    store's server does, with SO_REUSEADDR: a port held only by closed connections is free)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as err:
                if err.errno == errno.EADDRNOTAVAIL:  # the family has no address here
                    continue
                return False
    return True


def local_port(rng: Optional[random.Random] = None, tries: int = 64,
               ephemeral: Optional[Tuple[int, int]] = None) -> int:
    """A free port outside the ephemeral range, for a job whose ranks all run on this host.

    Only a process that binds that very port by number can take it before rank 0 does; no
    outgoing connection can. Where the whole range is ephemeral, the kernel's own choice."""
    rng = rng or random.SystemRandom()
    ranges = _candidates(ephemeral or ephemeral_range())
    if ranges:
        for _ in range(tries):
            span = rng.choice(ranges)
            port = span[rng.randrange(len(span))]
            if is_free(port):
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def job_port(job_id: str) -> int:
    """The port of a job whose ranks span hosts: the same on every rank, from the job id alone,
    below Linux's default ephemeral range (each host's own range is not known to the others)."""
    return LOWEST + zlib.crc32(str(job_id).encode()) % (DEFAULT_EPHEMERAL[0] - LOWEST)
