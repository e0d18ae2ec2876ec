"""Listening: the caller's microphone as 16 kHz PCM, voice activity, barge-in and transcripts.

Pure parts (`inbound`, `vad`, `bargein`) have no threads and take injected clocks; `models` loads
Silero VAD (onnxruntime) and faster-whisper once per process; `transcriber` owns the Whisper thread;
`listener` glues one call's microphone track to all of them.
"""

from voicertc.listen.bargein import BargeInDecision, BargeInPolicy, has_content_word
from voicertc.listen.inbound import InboundBuffer, to_16k_mono
from voicertc.listen.vad import SpeechStarted, SpeechStopped, VadEvent, VadStateMachine

__all__ = [
    "BargeInDecision",
    "BargeInPolicy",
    "InboundBuffer",
    "SpeechStarted",
    "SpeechStopped",
    "VadEvent",
    "VadStateMachine",
    "has_content_word",
    "to_16k_mono",
]
