"""The caller's 16 kHz PCM hops from the listening thread to the loop's buffers one frame at a time while
someone reads it (`Call.listen()`, an audio WebSocket tap), 200 ms at a time while nobody does; either
way every frame arrives once, in order."""

from __future__ import annotations

import asyncio

import numpy as np

from voicertc.config import ListenConfig
from voicertc.listen.listener import FRAME_SAMPLES, PCM_BATCH_FRAMES, CallListener, ListenThread


def ramp_frames(n: int) -> list[np.ndarray]:
    """n 20 ms frames of 16 kHz int16 whose samples count up (quiet: Silero is skipped)."""
    values = (np.arange(n * FRAME_SAMPLES) % 200).astype(np.int16)
    return [values[i * FRAME_SAMPLES : (i + 1) * FRAME_SAMPLES] for i in range(n)]


def run_thread(frames: list[np.ndarray], readers_from: int | None) -> list[list[np.ndarray]]:
    posts: list[list[np.ndarray]] = []

    def post(kind: str, *args: object) -> None:
        if kind == "pcm":
            posts.append(list(args[0]))  # type: ignore[call-overload]

    thread = ListenThread("hops", ListenConfig(), post, None)
    for index, pcm in enumerate(frames):
        if readers_from is not None and index == readers_from:
            thread.live_readers = 1
        thread.process(pcm, 16000, 1, index * FRAME_SAMPLES, FRAME_SAMPLES)
    return posts


def test_with_nobody_reading_frames_hop_in_batches_and_all_arrive_in_order():
    frames = ramp_frames(3 * PCM_BATCH_FRAMES + 4)
    posts = run_thread(frames, readers_from=None)
    assert [len(batch) for batch in posts] == [PCM_BATCH_FRAMES] * 3  # 4 still wait for the next hop
    np.testing.assert_array_equal(
        np.concatenate(sum(posts, [])), np.concatenate(frames[: 3 * PCM_BATCH_FRAMES])
    )


def test_a_reader_gets_every_frame_as_it_comes_and_the_waiting_ones_first():
    frames = ramp_frames(20)
    posts = run_thread(frames, readers_from=4)
    assert [len(batch) for batch in posts] == [5] + [1] * 15  # the 4 waiting frames go with the 5th
    np.testing.assert_array_equal(np.concatenate(sum(posts, [])), np.concatenate(frames))


async def test_readers_are_counted_while_they_read():
    listener = CallListener("hops", ListenConfig(), lambda event: None, lambda: None, lambda d: None, None)
    thread = listener.thread
    assert thread.live_readers == 0
    tap = listener.tap()
    assert thread.live_readers == 1
    listener.untap(tap)
    listener.untap(tap)  # twice: counted once
    assert thread.live_readers == 0

    got: list[np.ndarray] = []

    async def read() -> None:
        async for frame in listener.frames():
            got.append(frame)

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    assert thread.live_readers == 1
    for index, pcm in enumerate(ramp_frames(3)):  # as the decoder thread would, one frame each
        thread.process(pcm, 16000, 1, index * FRAME_SAMPLES, FRAME_SAMPLES)
    for _ in range(20):
        if len(got) == 3:
            break
        await asyncio.sleep(0.01)
    assert len(got) == 3
    await listener.close()
    await asyncio.wait_for(reader, 5.0)
    assert thread.live_readers == 0
