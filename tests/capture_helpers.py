"""The CPU stand-in for a CUDA capture in the captured-step tests: the static step runs each time
(`run_eagerly`'s behaviour), and the captures and replays are counted."""

from __future__ import annotations


class CountingCapture:
    def __init__(self) -> None:
        self.captured = 0
        self.replays = 0

    def __call__(self, step):
        self.captured += 1

        def replay():
            self.replays += 1
            return step()

        return replay
