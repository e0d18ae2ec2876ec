"""The few error types voicertc raises at its edges."""

from __future__ import annotations


class VoiceRTCError(Exception):
    """Base of every error voicertc raises on purpose."""

    code = "voicertc_error"
    field = ""  # the request field at fault, where one is ("text", "voice", "speed", ...)


class ConfigError(VoiceRTCError):
    """A config file or value is wrong; the message names the key."""

    code = "config_error"


class ModelDirError(VoiceRTCError):
    """A model directory is missing a file or holds a wrong one; the message names the file."""

    code = "model_dir_error"


class UnknownVoiceError(VoiceRTCError):
    """A voice id that the engine does not have."""

    code = "unknown_voice"


class InputError(VoiceRTCError):
    """Bad text or audio given to the engine (empty, too long, not audio...)."""

    code = "bad_input"


class VoiceExistsError(InputError):
    """A registration names a voice id that is taken (HTTP 409)."""

    code = "voice_exists"


class VoiceReadOnlyError(InputError):
    """A voice that came with the engine or its model (spk2info.pt) cannot be deleted (HTTP 409)."""

    code = "voice_read_only"


class UtteranceTooLongError(VoiceRTCError):
    """An utterance's audio passed `[limits] max_utterance_s`; what was synthesized up to it is kept."""

    code = "utterance_too_long"


class EngineStoppedError(VoiceRTCError):
    """The engine is not running (not started, stopped, or its backend failed to load)."""

    code = "engine_stopped"


class EngineUnavailableError(EngineStoppedError):
    """The remote engine (Ray Serve app) cannot be reached, or speaks another version (HTTP 503)."""

    code = "engine_unavailable"

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotSupportedError(VoiceRTCError):
    """The engine cannot do this (e.g. Piper registering a voice)."""

    code = "not_supported"
