"""The session pins and replica health of one front-end process, shared by its client and its routers.

Serve pickles the router's own module by value (its globals are copied into each router), so the
state lives here, in a module the router imports by reference: the client (`RemoteEngine`) and every
`SessionAffinityRouter` of the process see the same pins. No Ray import.

Health is per replica: a replica the client saw fail (a stall, a death, a probe that timed out) is
avoided while another one is usable, and taken back the moment a probe of it succeeds. Load is per
replica too: the utterances this process has open on it (counted at once, released at once) plus what
the replica itself last reported for the other front-ends (`report_load`; the replica tells them apart
by the `FRONT_END` id each stream carries).
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable

MAX_SESSIONS = 100_000  # pins kept per front-end process (least recently used dropped first)
FRONT_END = uuid.uuid4().hex  # this process, as the replicas know it (they report the others' load)

_lock = threading.Lock()
_pins: OrderedDict[str, str] = OrderedDict()  # session key -> replica unique id
_lost: dict[str, float] = {}  # replica the client saw fail -> when: avoided while another one is usable
_replicas: dict[str, list[str]] = {}  # app name -> its running replicas (the routers' view)
_local_open: dict[str, int] = {}  # replica -> utterances this process has open on it
_others: dict[str, int] = {}  # replica -> utterances other front-ends have open on it (its last report)


def pinned_replica(session: str) -> str | None:
    """The replica unique id a session is pinned to (None: not pinned yet)."""
    with _lock:
        return _pins.get(session)


def forget_session(session: str) -> None:
    """The call ended: drop its pin."""
    with _lock:
        _pins.pop(session, None)


def forget_replica(replica: str) -> None:
    """A replica failed under a request (or a probe): unpin its sessions; avoid it until it recovers."""
    with _lock:
        _lost.setdefault(replica, time.monotonic())
        for session in [s for s, r in _pins.items() if r == replica]:
            del _pins[session]


def recovered(replica: str) -> bool:
    """A probe of the replica succeeded: it takes new sessions again. True when it was avoided."""
    with _lock:
        return _lost.pop(replica, None) is not None


def avoided(replica: str) -> bool:
    with _lock:
        return replica in _lost


def avoided_replicas() -> list[str]:
    with _lock:
        return sorted(_lost)


def set_replicas(app: str, replicas: list[str]) -> None:
    """The routers' current replica set of `app` (unique ids); dropped replicas are forgotten."""
    with _lock:
        gone = set(_replicas.get(app, ())) - set(replicas)
        _replicas[app] = sorted(replicas)
        for rid in gone:
            _lost.pop(rid, None)
            _others.pop(rid, None)


def known_replicas(app: str) -> list[str]:
    with _lock:
        return list(_replicas.get(app, ()))


def utterance_opened(replica: str) -> None:
    with _lock:
        _local_open[replica] = _local_open.get(replica, 0) + 1


def utterance_closed(replica: str) -> None:
    """An utterance ended (done, failed, cancelled): it stops counting now, not at the next report."""
    with _lock:
        left = _local_open.get(replica, 0) - 1
        if left > 0:
            _local_open[replica] = left
        else:
            _local_open.pop(replica, None)


def report_load(replica: str, others_open: int) -> None:
    """What the replica said the OTHER front-ends have open on it (it counts by `FRONT_END`)."""
    with _lock:
        _others[replica] = max(0, others_open)


def load(replica: str) -> int:
    with _lock:
        return _load(replica)


def _load(replica: str) -> int:
    return _local_open.get(replica, 0) + _others.get(replica, 0)  # ours now + the others' at the report


def choose(session: str | None, candidates: list[str], queue_len: Callable[[str], int]) -> str | None:
    """The replica for a request of `session` among `candidates` (unique ids). A pinned session keeps
    its replica while it is usable; a new one goes to the least loaded usable replica (open utterances,
    then pinned sessions, then Serve's queue length), ties split by the session key so that front-ends
    starting at once do not all pick the same one."""
    with _lock:
        usable = [rid for rid in candidates if rid not in _lost]
        if not usable and candidates:  # every one failed once: the one that failed longest ago
            usable = [min(candidates, key=lambda rid: _lost[rid])]
        if not usable:
            return None
        if session is not None and (pinned := _pins.get(session)) in usable:
            _pins.move_to_end(session)
            return pinned
        pins = dict.fromkeys(usable, 0)
        for rid in _pins.values():
            if rid in pins:
                pins[rid] += 1
        spread = zlib.crc32((session or "").encode())
        order = {rid: (i + spread) % len(usable) for i, rid in enumerate(usable)}
        chosen = min(usable, key=lambda rid: (_load(rid), pins[rid], queue_len(rid), order[rid]))
        if session is not None:
            _pins[session] = chosen
            while len(_pins) > MAX_SESSIONS:
                _pins.popitem(last=False)
        return chosen


def reset() -> None:
    """Forget everything (tests)."""
    with _lock:
        for table in (_pins, _lost, _replicas, _local_open, _others):
            table.clear()
