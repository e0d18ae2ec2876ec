"""`config.toml` → frozen dataclasses, validated once at start and passed down.

Every section of the file maps onto one dataclass below; every key onto one field. Unknown sections,
unknown keys, wrong types and out-of-range values raise `ConfigError` naming `section.key`.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from voicertc.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    use_uvloop: bool = True
    static_dir: str = ""
    public_url: str = ""
    cors_origins: tuple[str, ...] = ()
    drain_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def validate(self) -> None:
        _check(0 <= self.port <= 65535, "server.port", "must be 0..65535")
        _check(0 < self.body_timeout_s <= 600, "server.body_timeout_s", "must be > 0 and <= 600")
        ok_url = not self.public_url or self.public_url.startswith(("http://", "https://"))
        _check(ok_url, "server.public_url", "must be empty or an http(s):// URL")
        _check(
            all(o == "*" or _is_origin(o) for o in self.cors_origins),
            "server.cors_origins",
            'must hold "*" or origins like "https://app.example.com" (scheme://host[:port], no path)',
        )
        _check(0 <= self.drain_timeout_s <= 3600, "server.drain_timeout_s", "must be 0..3600")


def _is_origin(origin: str) -> bool:
    scheme, sep, rest = origin.partition("://")
    return scheme in ("http", "https") and bool(sep) and bool(rest) and not any(c in rest for c in "/?# ")


@dataclass(frozen=True)
class WebRTCConfig:
    ice_servers: tuple[str, ...] = ()
    loopback_only: bool = False
    frame_ms: int = 20
    sample_rate_hz: int = 48000
    stereo: bool = True
    interrupt_fade_ms: int = 10
    connect_timeout_s: float = 30.0
    pending_timeout_s: float = 10.0
    keepalive_timeout_s: float = 10.0
    trim_leading_silence_ms: int = 100
    udp_port_min: int = 0
    udp_port_max: int = 0
    dtx: bool = True

    def validate(self) -> None:
        ice_ok = all(u.startswith(("stun:", "stuns:", "turn:", "turns:")) for u in self.ice_servers)
        _check(ice_ok, "webrtc.ice_servers", "must hold stun:/stuns:/turn:/turns: URLs")
        if (self.udp_port_min, self.udp_port_max) != (0, 0):  # 0, 0 = any port the kernel picks
            ok_min = 1024 <= self.udp_port_min <= 65535
            _check(ok_min, "webrtc.udp_port_min", "must be 1024..65535 (or both 0)")
            _check(
                self.udp_port_min <= self.udp_port_max <= 65535,
                "webrtc.udp_port_max",
                "must be udp_port_min..65535 (or both 0)",
            )
        _check(self.frame_ms in (10, 20), "webrtc.frame_ms", "must be 10 or 20")
        _check(self.sample_rate_hz == 48000, "webrtc.sample_rate_hz", "must be 48000 (Opus)")
        _check(0 <= self.interrupt_fade_ms <= 100, "webrtc.interrupt_fade_ms", "must be 0..100")
        _check(self.connect_timeout_s > 0, "webrtc.connect_timeout_s", "must be > 0")
        _check(0 < self.pending_timeout_s <= 300, "webrtc.pending_timeout_s", "must be > 0 and <= 300")
        _check(self.keepalive_timeout_s > 0, "webrtc.keepalive_timeout_s", "must be > 0")
        _check(0 <= self.trim_leading_silence_ms <= 1000, "webrtc.trim_leading_silence_ms", "must be 0..1000")


@dataclass(frozen=True)
class TurnConfig:
    """A TURN relay that shares `secret` with this server (coturn `use-auth-secret`): clients get
    credentials that expire after `ttl_s`, never the secret."""

    secret: str = ""
    urls: tuple[str, ...] = ()
    ttl_s: int = 3600

    def validate(self) -> None:
        turn_ok = all(u.startswith(("turn:", "turns:")) for u in self.urls)
        _check(turn_ok, "turn.urls", "must hold turn: or turns: URLs")
        _check(not self.urls or bool(self.secret), "turn.secret", "is required when turn.urls is set")
        _check(not self.secret or bool(self.urls), "turn.urls", "is required when turn.secret is set")
        _check(60 <= self.ttl_s <= 7 * 86400, "turn.ttl_s", "must be 60..604800")


BACKENDS = ("piper", "fake", "cosyvoice2", "cosyvoice3")  # the models an engine runs (in-process or replica)
ENGINE_KINDS = ("local", "ray")  # where the engine runs; `engine.model` names the model then


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "piper"
    model_dir: str = ""
    device: str = "auto"
    dtype: str = "float32"
    default_voice: str = ""
    voices_dir: str = "voices"
    max_queued_ms: int = 4000
    piper_threads: int = 1
    first_clause_min_chars: int = 12
    workers: int = 1
    load_in_background: bool = False
    model: str = ""
    max_ahead_ms: int = 2000
    max_step_ms: int = 200
    piper_piece_phonemes: int = 0
    max_batch: int = 16
    estimator: str = "torch"
    compile: bool = False
    cuda_graphs: bool = False
    graph_memory_mb: int = 0  # captured buckets' memory, all stages together (0 = a quarter of the card)
    llm: str = "torch"
    accel_dir: str = ""
    text_workers: int = 1  # CosyVoice text normalisation processes (0 = on the engine thread)
    bistream_unit: str = "word"  # CosyVoice text deltas enter the LLM per completed word | sentence
    max_streaming: int = (
        0  # CosyVoice utterances holding flow contexts at once (0 = auto: GPU memory; CPU: any)
    )
    streaming_context_s: float = 30.0  # own speech an auto max_streaming gives each room for (prompts shared)
    dit_conv: str = "conv1d"  # CosyVoice3 DiT position convs: conv1d | matmul (one batched matmul each)

    @property
    def model_name(self) -> str:
        """The model this engine runs: `backend` when it names one, else `model` ("" = piper)."""
        return self.backend if self.backend in BACKENDS else (self.model or "piper")

    @property
    def remote(self) -> bool:
        """The engine is a Ray Serve deployment (this process is a front-end)."""
        return self.backend == "ray"

    def validate(self) -> None:
        kinds = BACKENDS + ENGINE_KINDS
        _check(self.backend in kinds, "engine.backend", f"must be one of {', '.join(kinds)}")
        _check(
            self.model in ("", *BACKENDS), "engine.model", f"must be empty or one of {', '.join(BACKENDS)}"
        )
        ok_model = not self.model or self.backend in ENGINE_KINDS or self.model == self.backend
        _check(ok_model, "engine.model", "is only used with backend 'local' or 'ray' (or must match backend)")
        _check(100 <= self.max_ahead_ms <= 120_000, "engine.max_ahead_ms", "must be 100..120000")
        _check(self.dtype in ("float32", "float16", "bfloat16"), "engine.dtype", "bad dtype")
        ok_device = self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")
        _check(ok_device, "engine.device", "must be auto, cpu, cuda or cuda:N")
        _check(200 <= self.max_queued_ms <= 120_000, "engine.max_queued_ms", "must be 200..120000")
        _check(1 <= self.piper_threads <= 64, "engine.piper_threads", "must be 1..64")
        _check(0 <= self.first_clause_min_chars <= 200, "engine.first_clause_min_chars", "must be 0..200")
        _check(1 <= self.workers <= 64, "engine.workers", "must be 1..64")
        _check(20 <= self.max_step_ms <= 10_000, "engine.max_step_ms", "must be 20..10000")
        ok_piece = self.piper_piece_phonemes == 0 or 8 <= self.piper_piece_phonemes <= 2000
        _check(ok_piece, "engine.piper_piece_phonemes", "must be 0 (sized from max_step_ms) or 8..2000")
        _check(1 <= self.max_batch <= 256, "engine.max_batch", "must be 1..256")
        _check(0 <= self.text_workers <= 16, "engine.text_workers", "must be 0..16")
        _check(self.bistream_unit in ("word", "sentence"), "engine.bistream_unit", "must be word | sentence")
        _check(0 <= self.max_streaming <= 4096, "engine.max_streaming", "must be 0 (auto) or 1..4096")
        _check(1.0 <= self.streaming_context_s <= 600.0, "engine.streaming_context_s", "must be 1..600 s")
        _check(self.dit_conv in ("conv1d", "matmul"), "engine.dit_conv", "must be conv1d | matmul")
        ok_dit = self.dit_conv == "conv1d" or self.model_name == "cosyvoice3"
        _check(ok_dit, "engine.dit_conv", "matmul applies to CosyVoice3's DiT only (backend cosyvoice3)")
        _check(
            self.estimator in ("torch", "onnx", "tensorrt"),
            "engine.estimator",
            "must be torch, onnx or tensorrt",
        )
        _check(self.llm in ("torch", "thread", "vllm"), "engine.llm", "must be torch, thread or vllm")
        _check(0 <= self.graph_memory_mb <= 1_000_000, "engine.graph_memory_mb", "must be 0..1000000")
        ok_graphs = not self.cuda_graphs or self.device.startswith("cuda")
        _check(ok_graphs, "engine.cuda_graphs", 'needs engine.device = "cuda" (or cuda:N)')
        if self.model_name in ("cosyvoice2", "cosyvoice3"):
            name = self.model_name
            _check(bool(self.model_dir), "engine.model_dir", f"is required for model {name}")
            _check(self.workers == 1, "engine.workers", f"must be 1 for {name} (one owner of the device)")
        if self.model_name == "cosyvoice3":  # these paths exist for CosyVoice2's networks only
            _check(self.estimator == "torch", "engine.estimator", "must be torch for cosyvoice3")
            _check(self.llm == "torch", "engine.llm", "must be torch for cosyvoice3")
            ok_compile = not self.compile or self.cuda_graphs  # v3: the captured decode step only
            _check(ok_compile, "engine.compile", "needs engine.cuda_graphs for cosyvoice3")


@dataclass(frozen=True)
class ScheduleConfig:
    first_hop_tokens: int = 25
    growth: int = 2
    max_hop_tokens: int = 100
    lookahead_tokens: int = 3
    grid_tokens: int = 0
    final_chunk: str = "chunk_mask"

    def validate(self) -> None:
        _check(self.first_hop_tokens >= 1, "schedule.first_hop_tokens", "must be >= 1")
        _check(self.grid_tokens >= 0, "schedule.grid_tokens", "must be >= 0 (0 = the first hop)")
        _check(self.growth >= 1, "schedule.growth", "must be >= 1")
        _check(
            self.max_hop_tokens >= self.first_hop_tokens, "schedule.max_hop_tokens", "must be >= first hop"
        )
        _check(self.lookahead_tokens >= 0, "schedule.lookahead_tokens", "must be >= 0")
        modes = ("chunk_mask", "reference")
        _check(self.final_chunk in modes, "schedule.final_chunk", f"must be one of {', '.join(modes)}")


@dataclass(frozen=True)
class FakeConfig:
    ttfa_ms: int = 50
    rtf: float = 0.1
    chunk_ms: int = 200
    tone_hz: float = 440.0
    fail_after_chunks: int = -1
    voice_book: bool = (
        False  # register / delete voices in memory (off: built-in voices only, 400 not_supported)
    )

    def validate(self) -> None:
        _check(self.ttfa_ms >= 0, "fake.ttfa_ms", "must be >= 0")
        _check(0 <= self.rtf <= 10, "fake.rtf", "must be 0..10")
        _check(10 <= self.chunk_ms <= 10_000, "fake.chunk_ms", "must be 10..10000")
        _check(0 <= self.tone_hz < 12_000, "fake.tone_hz", "must be 0..12000")


@dataclass(frozen=True)
class LimitsConfig:
    max_text_chars: int = 20_000
    max_calls: int = 16
    max_pending_calls: int = 4
    max_utterances: int = 64
    max_queued_utterances: int = 32
    text_idle_timeout_s: float = 30.0
    voice_min_s: float = 1.0
    voice_max_s: float = 30.0
    voice_max_bytes: int = 10 * 1024 * 1024
    max_utterance_s: float = 120.0
    max_speech_tokens_per_segment: int = 2000  # CosyVoice: the LLM stops here (80 s of speech at 25 Hz)
    max_voices: int = 64
    max_voices_per_token: int = 8
    max_pending_total: int = 8

    def validate(self) -> None:
        _check(self.max_text_chars >= 1, "limits.max_text_chars", "must be >= 1")
        _check(0 <= self.max_voices <= 100_000, "limits.max_voices", "must be 0..100000")
        _check(0 <= self.max_voices_per_token <= 100_000, "limits.max_voices_per_token", "must be 0..100000")
        _check(self.max_pending_total >= 1, "limits.max_pending_total", "must be >= 1")
        _check(self.max_calls >= 1, "limits.max_calls", "must be >= 1")
        _check(self.max_pending_calls >= 1, "limits.max_pending_calls", "must be >= 1")
        _check(self.max_utterances >= 1, "limits.max_utterances", "must be >= 1")
        _check(self.max_queued_utterances >= 1, "limits.max_queued_utterances", "must be >= 1")
        _check(self.text_idle_timeout_s > 0, "limits.text_idle_timeout_s", "must be > 0")
        _check(0.5 <= self.voice_min_s <= 30.0, "limits.voice_min_s", "must be 0.5..30")
        _check(self.voice_min_s <= self.voice_max_s <= 30.0, "limits.voice_max_s", "must be voice_min_s..30")
        _check(
            1024 <= self.voice_max_bytes <= 100 * 1024 * 1024,
            "limits.voice_max_bytes",
            "must be 1 KiB..100 MiB",
        )
        _check(1 <= self.max_utterance_s <= 3600, "limits.max_utterance_s", "must be 1..3600")
        _check(
            25 <= self.max_speech_tokens_per_segment <= 90_000,
            "limits.max_speech_tokens_per_segment",
            "must be 25..90000",
        )


@dataclass(frozen=True)
class AuthConfig:
    tokens: tuple[str, ...] = ()
    admin_tokens: tuple[str, ...] = ()
    protect_metrics: bool = False

    def validate(self) -> None:
        _check(all(t.strip() for t in self.tokens), "auth.tokens", "must not contain empty tokens")
        _check(all(t.strip() for t in self.admin_tokens), "auth.admin_tokens", "must not hold empty tokens")
        _check(
            not self.protect_metrics or bool(self.tokens or self.admin_tokens),
            "auth.protect_metrics",
            "needs auth.tokens or auth.admin_tokens (a token to read /metrics with)",
        )

    @property
    def enabled(self) -> bool:
        """Bearer tokens are required on /v1 (some token is configured)."""
        return bool(self.tokens or self.admin_tokens)


BARGE_IN_MODES = ("off", "speech", "words")
DEFAULT_BACKCHANNELS = (
    "mhm",
    "mm",
    "mmhm",
    "uh-huh",
    "uh huh",
    "hmm",
    "hm",
    "yeah",
    "yes",
    "yep",
    "okay",
    "ok",
    "right",
    "sure",
    "alright",
    "got it",
    "i see",
    "uh",
    "um",
    "ah",
    "oh",
)


@dataclass(frozen=True)
class ListenConfig:
    enabled: bool = True
    threshold: float = 0.5
    min_level_dbfs: float = -50.0
    min_speech_ms: int = 200
    min_silence_ms: int = 300
    speech_pad_ms: int = 60
    barge_in: str = "speech"
    backchannels: tuple[str, ...] = DEFAULT_BACKCHANNELS
    transcribe: bool = True
    whisper_threads: int = 1
    whisper_workers: int = 0
    transcript_queue: int = 8
    partial_every_ms: int = 400
    max_segment_s: float = 30.0
    inbound_buffer_ms: int = 2000
    mic_jitter_frames: int = 1
    ws_stall_timeout_s: float = 2.0

    def validate(self) -> None:
        _check(0.05 <= self.threshold <= 0.95, "listen.threshold", "must be 0.05..0.95")
        _check(-90 <= self.min_level_dbfs <= -10, "listen.min_level_dbfs", "must be -90..-10")
        _check(32 <= self.min_speech_ms <= 5000, "listen.min_speech_ms", "must be 32..5000")
        _check(32 <= self.min_silence_ms <= 5000, "listen.min_silence_ms", "must be 32..5000")
        _check(0 <= self.speech_pad_ms <= 1000, "listen.speech_pad_ms", "must be 0..1000")
        _check(
            self.barge_in in BARGE_IN_MODES, "listen.barge_in", f"must be one of {', '.join(BARGE_IN_MODES)}"
        )
        _check(
            all(w.strip() for w in self.backchannels), "listen.backchannels", "must not contain empty words"
        )
        _check(
            self.barge_in != "words" or self.transcribe,
            "listen.barge_in",
            '"words" needs listen.transcribe = true (the words come from the transcript)',
        )
        _check(1 <= self.whisper_threads <= 16, "listen.whisper_threads", "must be 1..16")
        _check(0 <= self.whisper_workers <= 16, "listen.whisper_workers", "must be 0 (auto) ..16")
        _check(1 <= self.transcript_queue <= 1000, "listen.transcript_queue", "must be 1..1000")
        _check(100 <= self.partial_every_ms <= 5000, "listen.partial_every_ms", "must be 100..5000")
        _check(1 <= self.max_segment_s <= 120, "listen.max_segment_s", "must be 1..120")
        _check(1 <= self.mic_jitter_frames <= 8, "listen.mic_jitter_frames", "must be 1..8")
        _check(100 <= self.inbound_buffer_ms <= 60_000, "listen.inbound_buffer_ms", "must be 100..60000")
        _check(0.1 <= self.ws_stall_timeout_s <= 60, "listen.ws_stall_timeout_s", "must be 0.1..60")


@dataclass(frozen=True)
class LoggingConfig:
    level: str = "INFO"

    def validate(self) -> None:
        _check(self.level in ("DEBUG", "INFO", "WARNING", "ERROR"), "logging.level", "bad level")


@dataclass(frozen=True)
class RayConfig:
    """Where the remote engine runs (`engine.backend = "ray"`) and how its replicas are deployed."""

    address: str = "auto"
    namespace: str = "voicertc"
    app_name: str = "voicertc-engine"
    auth_mode: str = "token"
    auth_token_path: str = ""
    num_replicas: int = 1
    autoscale: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 8.0
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 64
    connect_timeout_s: float = 30.0
    open_timeout_s: float = 10.0
    stall_timeout_s: float = 10.0
    control_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    retry_after_s: int = 5

    def validate(self) -> None:
        _check(bool(self.address.strip()), "ray.address", 'must not be empty ("auto", host:port, ray://...)')
        _check(bool(self.namespace.strip()), "ray.namespace", "must not be empty")
        _check(bool(self.app_name.strip()), "ray.app_name", "must not be empty")
        _check(self.auth_mode in ("token", "disabled"), "ray.auth_mode", "must be token or disabled")
        _check(1 <= self.num_replicas <= 1024, "ray.num_replicas", "must be 1..1024")
        _check(0 <= self.min_replicas <= 1024, "ray.min_replicas", "must be 0..1024")
        _check(
            self.max_replicas >= max(1, self.min_replicas),
            "ray.max_replicas",
            "must be >= min_replicas, >= 1",
        )
        _check(self.target_ongoing_requests > 0, "ray.target_ongoing_requests", "must be > 0")
        _check(0 <= self.num_cpus <= 256, "ray.num_cpus", "must be 0..256")
        _check(0 <= self.num_gpus <= 16, "ray.num_gpus", "must be 0..16 (fractions pack replicas on a GPU)")
        _check(1 <= self.max_ongoing_requests <= 10_000, "ray.max_ongoing_requests", "must be 1..10000")
        for key in ("connect_timeout_s", "open_timeout_s", "stall_timeout_s", "control_timeout_s"):
            _check(getattr(self, key) > 0, f"ray.{key}", "must be > 0")
        _check(self.health_interval_s > 0, "ray.health_interval_s", "must be > 0")
        _check(1 <= self.retry_after_s <= 3600, "ray.retry_after_s", "must be 1..3600")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    webrtc: WebRTCConfig = field(default_factory=WebRTCConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    fake: FakeConfig = field(default_factory=FakeConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    turn: TurnConfig = field(default_factory=TurnConfig)
    listen: ListenConfig = field(default_factory=ListenConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def replace(self, section: str, **values: Any) -> Config:
        """A copy with some keys of one section changed (command-line overrides), validated."""
        new_section = _build_section(
            type(getattr(self, section)), section, values, base=getattr(self, section)
        )
        return dataclasses.replace(self, **{section: new_section})


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _coerce(key: str, kind: Any, value: Any) -> Any:
    if kind is bool:
        _check(isinstance(value, bool), key, "must be true or false")
        return value
    if kind is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, "must be an integer")
        return value
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        _check(ok, key, "must be a number")
        return float(value)
    if kind is str:
        _check(isinstance(value, str), key, "must be a string")
        return value
    ok = isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    _check(ok, key, "must be a list of strings")
    return tuple(value)


def _build_section(cls: type, section: str, values: dict[str, Any], base: Any = None) -> Any:
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    for key in values:
        _check(key in names, f"{section}.{key}", "unknown key")
    coerced = {k: _coerce(f"{section}.{k}", hints[k], v) for k, v in values.items()}
    obj = dataclasses.replace(base, **coerced) if base is not None else cls(**coerced)
    obj.validate()
    return obj


def config_from_dict(data: dict[str, Any]) -> Config:
    """A validated Config from parsed TOML; missing keys keep their defaults."""
    sections = {f.name: f for f in fields(Config)}
    built: dict[str, Any] = {}
    for name, values in data.items():
        _check(name in sections, name, "unknown section")
        _check(isinstance(values, dict), name, "must be a table")
        built[name] = _build_section(get_type_hints(Config)[name], name, values)
    return Config(**built)


def load_config(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> Config:
    """Read and validate `config.toml` (or the defaults when `path` is None). `overrides` (section ->
    keys, e.g. command-line flags) replace the file's keys BEFORE validation, so flags that only make
    sense together (`--model cosyvoice2 --model-dir D`) are checked together."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config ({exc.strerror})") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from exc
    for section, values in (overrides or {}).items():
        current = data.get(section, {})
        _check(isinstance(current, dict), section, "must be a table")
        data[section] = {**current, **values}
    return config_from_dict(data)
