"""Data-channel messages no larger than the answer advertises. Runs on the event loop (aiortc's).

The SDP answer says `a=max-message-size:262144`, but aiortc reassembles whatever arrives: a 5 MB
message became ~4,000 fragments, and since aiortc rescans its whole reassembly list on every fragment
the work grows with the square of the size (the loop held 1.1-7.4 s; a 20 MB message held its
channel 120 s). `limit_inbound_messages` swaps each inbound stream of one association for a
`BoundedInboundStream`: once the fragments it holds pass the advertised size (plus `SLACK_BYTES` for
small messages waiting behind a lost one), it drops them, accepts nothing more on that stream and
calls `on_too_large` once. The caller (`Call`) then reports `error` `message_too_large` and closes
the channel; the call's audio and every other call go on. Reassembly work stays bounded by the limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from aiortc.rtcsctptransport import DataChunk, InboundStream, RTCSctpTransport

logger = logging.getLogger(__name__)

SLACK_BYTES = 64 * 1024


class BoundedInboundStream(InboundStream):
    """aiortc's reassembly for one SCTP stream, refusing to hold more than `max_bytes`."""

    def __init__(self, max_bytes: int, on_too_large: Callable[[int], None]) -> None:
        super().__init__()
        self.max_bytes = max_bytes
        self.on_too_large = on_too_large
        self.buffered_bytes = 0  # user data held in `reassembly`
        self.refused = False

    def add_chunk(self, chunk: DataChunk) -> None:
        if self.refused:
            return
        super().add_chunk(chunk)
        self.buffered_bytes += len(chunk.user_data)
        if self.buffered_bytes > self.max_bytes:
            held = self.buffered_bytes
            self.refused = True
            self.reassembly = []
            self.buffered_bytes = 0
            self.on_too_large(held)

    def pop_messages(self) -> Iterator[tuple[int, int, bytes]]:
        for message in super().pop_messages():
            self.buffered_bytes -= len(message[2])
            yield message

    def prune_chunks(self, tsn: int) -> int:
        size = super().prune_chunks(tsn)
        self.buffered_bytes -= size
        return size


def advertised_max_bytes(sctp: RTCSctpTransport) -> int:
    """The `max-message-size` our SDP answer advertises for this association."""
    return int(sctp.getCapabilities().maxMessageSize)


def limit_inbound_messages(sctp: RTCSctpTransport, on_too_large: Callable[[int, int], None]) -> int:
    """Bound every inbound stream of `sctp` to the advertised message size; returns that size.
    `on_too_large(stream_id, bytes_held)` runs once per stream that passes it."""
    limit = advertised_max_bytes(sctp)
    streams: dict[int, InboundStream] = sctp._inbound_streams

    def get_inbound_stream(stream_id: int) -> InboundStream:
        if stream_id not in streams:
            streams[stream_id] = BoundedInboundStream(
                limit + SLACK_BYTES, lambda held: on_too_large(stream_id, held)
            )
        return streams[stream_id]

    sctp._get_inbound_stream = get_inbound_stream  # type: ignore[method-assign]
    return limit
