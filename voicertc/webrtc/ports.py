"""Binding aiortc's ICE candidates to a UDP port range (`[webrtc] udp_port_min/max`).

A container or a firewall opens a fixed range for media; aioice binds every host candidate to port 0
(any) and has no setting for it. `patch_aioice_port_range` makes the host-candidate sockets aioice
opens take a free port of the range instead (a random start, then upwards, so calls spread and a port
still held by a closing call is skipped). A range with no free port left binds nothing for that
address, which aioice logs; the call then fails to connect like any call without candidates.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def pick_ports(port_min: int, port_max: int, start: int) -> list[int]:
    """Every port of the range once, from `start` upwards, wrapping (the order binds are tried in)."""
    span = port_max - port_min + 1
    return [port_min + (start - port_min + i) % span for i in range(span)]


async def bind_in_range(
    loop: asyncio.AbstractEventLoop,
    protocol_factory: Callable[[], asyncio.DatagramProtocol],
    host: str,
    port_min: int,
    port_max: int,
    **kwargs: Any,
) -> tuple[asyncio.DatagramTransport, asyncio.DatagramProtocol]:
    """A UDP endpoint on `host` at the first free port of the range (OSError when none is free)."""
    last: OSError | None = None
    for port in pick_ports(port_min, port_max, random.randint(port_min, port_max)):
        try:
            return await loop.create_datagram_endpoint(protocol_factory, local_addr=(host, port), **kwargs)
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
            last = exc
    raise OSError(errno.EADDRINUSE, f"no free UDP port in {port_min}..{port_max} on {host}") from last


class _RangeLoop:
    """The running loop as aioice's candidate gathering sees it: host sockets go into the range."""

    def __init__(self, loop: asyncio.AbstractEventLoop, port_min: int, port_max: int) -> None:
        self._loop = loop
        self._range = (port_min, port_max)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    async def create_datagram_endpoint(
        self, protocol_factory: Callable[[], Any], local_addr: tuple[str, int] | None = None, **kwargs: Any
    ) -> tuple[Any, Any]:
        if local_addr is None or local_addr[1] != 0:
            loop = self._loop
            return await loop.create_datagram_endpoint(protocol_factory, local_addr=local_addr, **kwargs)
        return await bind_in_range(self._loop, protocol_factory, local_addr[0], *self._range, **kwargs)


def patch_aioice_port_range(port_min: int, port_max: int) -> Callable[[], None]:
    """Bind aioice's host candidates inside [port_min, port_max] (process-wide); returns the undo.

    Only `aioice.ice` (host candidates) sees the range: its module-level `asyncio` is replaced by a
    view whose `get_running_loop()` hands out a `_RangeLoop`; everything else passes through.
    """
    import aioice.ice

    original = aioice.ice.asyncio
    view = types.ModuleType("asyncio")
    view.__dict__.update(vars(asyncio))
    view.get_running_loop = lambda: _RangeLoop(asyncio.get_running_loop(), port_min, port_max)  # type: ignore[attr-defined]
    aioice.ice.asyncio = view
    logger.info("ICE host candidates bound to UDP ports %d..%d", port_min, port_max)

    def restore() -> None:
        if aioice.ice.asyncio is view:  # a later patch on top stays until it is undone itself
            aioice.ice.asyncio = original

    return restore
