"""voicertc: a real-time WebRTC voice component for conversational agents."""

__version__ = "0.1.0"
