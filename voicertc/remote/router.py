"""SessionAffinityRouter: every utterance of one call goes to the replica that served the call before.

Ray Serve builds one router per deployment handle, inside the caller's process (the front-end), and
asks it `choose_replicas` for each request. The call's session key travels as the request's `session`
keyword argument; `voicertc.remote.affinity` keeps the pins (this module is pickled by value, so it
holds no state). A session's first request goes to the candidate with the fewest pinned sessions; later
ones to the same replica while it is a candidate. A replica that died or drains is no candidate, and
one the client saw fail is avoided: the session's next request is pinned elsewhere. Requests naming a
`replica` (an open utterance's control messages) go to exactly that replica, or wait for it.

Serve's built-in multiplexing pinned 0 of 6 sessions under concurrent first use here: the pin is
recorded before the request is sent, so concurrent first requests of a session agree at once.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from voicertc.remote import affinity


def _kwarg(pending_request: PendingRequest | None, name: str) -> str | None:
    if pending_request is None:
        return None
    value = pending_request.kwargs.get(name)
    return value if isinstance(value, str) and value else None


class SessionAffinityRouter(RequestRouter):
    """Sticky routing by the `session` keyword argument; exact routing by the `replica` one."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        exact = _kwarg(pending_request, "replica")
        if exact is not None:
            return [[by_id[exact]]] if exact in by_id else []
        cache = self.replica_queue_len_cache

        def queue_len(rid: str) -> int:
            return cache.get(by_id[rid].replica_id) or 0

        chosen = affinity.choose(_kwarg(pending_request, "session"), sorted(by_id), queue_len)
        return [[by_id[chosen]]] if chosen is not None else []

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        affinity.forget_replica(replica_id.unique_id)
