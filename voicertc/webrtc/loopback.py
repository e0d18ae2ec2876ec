"""Keeping ICE on 127.0.0.1: for tests, CI inside a network namespace, and offline demos.

aioice never offers 127.0.0.1 and browsers never offer it either (environment.md §4); a server that
keeps only loopback remote candidates still connects over the peer-reflexive 127.0.0.1 candidate.
"""

from __future__ import annotations

from collections.abc import Callable

LOOPBACK_ADDRESS = "127.0.0.1"


def loopback_only_sdp(sdp: str) -> str:
    """`sdp` without the `a=candidate` lines whose address is not 127.0.0.1 (line endings kept)."""
    lines = sdp.splitlines(keepends=True)
    return "".join(line for line in lines if not _is_foreign_candidate(line))


def _is_foreign_candidate(line: str) -> bool:
    if not line.startswith("a=candidate:"):
        return False
    # a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ <type> ...
    fields = line.split()
    return len(fields) < 5 or fields[4] != LOOPBACK_ADDRESS


def patch_aioice_loopback() -> Callable[[], None]:
    """Make aioice gather only 127.0.0.1 host candidates (process-wide); returns a function that undoes it."""
    import aioice.ice

    original = aioice.ice.get_host_addresses

    def loopback_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [LOOPBACK_ADDRESS] if use_ipv4 else []

    aioice.ice.get_host_addresses = loopback_addresses

    def restore() -> None:
        aioice.ice.get_host_addresses = original

    return restore
