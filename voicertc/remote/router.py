"""SessionAffinityRouter: every utterance of one call goes to the replica that served the call before.

Ray Serve builds one router per deployment handle, inside the caller's process (the front-end), and
asks it `choose_replicas` for each request. The call's session key travels as the request's `session`
keyword argument; `voicertc.remote.affinity` keeps the pins, the replica set and the loads (this module
is pickled by value, so it holds no state). A session's first request goes to the least loaded usable
candidate (open utterances, then pinned sessions); later ones to the same replica while it is usable.
A replica that died or drains is no candidate, and one the client saw fail (or miss a health probe) is
avoided until it answers a probe again: the session's next request is pinned elsewhere. Requests naming
a `replica` (control messages, health probes) go to exactly that replica, or wait for it.

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
        if exact is not None and exact in by_id:
            return [[by_id[exact]]]
        # a replica that is gone: never wait for it (Serve would retry this choice in a loop); a control
        # message then finds no utterance there (answers False) and a probe answers for another replica
        cache = self.replica_queue_len_cache

        def queue_len(rid: str) -> int:
            return cache.get(by_id[rid].replica_id) or 0

        chosen = affinity.choose(_kwarg(pending_request, "session"), sorted(by_id), queue_len)
        return [[by_id[chosen]]] if chosen is not None else []

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        affinity.set_replicas(self._deployment_id.app_name, [r.replica_id.unique_id for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        affinity.forget_replica(replica_id.unique_id)
