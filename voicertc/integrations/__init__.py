"""voicertc inside agent frameworks: `pipecat.VoiceRTCTTSService` (extra `pipecat`) and
`livekit.TTS` (extra `livekit`), both on the `/v1/tts/stream` WebSocket (`ws_client`) or, handed a
running `VoiceServer`, on its engine in-process (`inprocess`). Import the submodule you need: each
imports its framework."""
