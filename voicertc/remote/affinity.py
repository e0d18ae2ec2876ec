"""The session pins of one front-end process, shared by its client and its request routers.

Serve pickles the router's own module by value (its globals are copied into each router), so the
state lives here, in a module the router imports by reference: the client (`RemoteEngine`) and every
`SessionAffinityRouter` of the process see the same pins. No Ray import.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_SESSIONS = 100_000  # pins kept per front-end process (least recently used dropped first)

_lock = threading.Lock()
_pins: OrderedDict[str, str] = OrderedDict()  # session key -> replica unique id
_lost: dict[str, float] = {}  # replica the client saw fail -> when: avoided while another one is usable


def pinned_replica(session: str) -> str | None:
    """The replica unique id a session is pinned to (None: not pinned yet)."""
    with _lock:
        return _pins.get(session)


def forget_session(session: str) -> None:
    """The call ended: drop its pin."""
    with _lock:
        _pins.pop(session, None)


def forget_replica(replica: str) -> None:
    """A replica failed under a request: unpin its sessions; avoid it from now on."""
    with _lock:
        _lost[replica] = time.monotonic()
        for session in [s for s, r in _pins.items() if r == replica]:
            del _pins[session]


def choose(session: str | None, candidates: list[str], queue_len: Callable[[str], int]) -> str | None:
    """The replica for a request of `session` among `candidates` (unique ids); pins a new session to
    the candidate with the fewest pinned sessions (then the shortest queue, then the id)."""
    with _lock:
        usable = [rid for rid in candidates if rid not in _lost]
        if not usable and candidates:  # every one failed once: the one that failed longest ago
            usable = [min(candidates, key=lambda rid: _lost[rid])]
        if not usable:
            return None
        if session is not None and (pinned := _pins.get(session)) in usable:
            _pins.move_to_end(session)
            return pinned
        load = dict.fromkeys(usable, 0)
        for rid in _pins.values():
            if rid in load:
                load[rid] += 1
        chosen = min(usable, key=lambda rid: (load[rid], queue_len(rid), rid))
        if session is not None:
            _pins[session] = chosen
            while len(_pins) > MAX_SESSIONS:
                _pins.popitem(last=False)
        return chosen
