# voicertc: the server with the bundled CPU voice (Piper) and CosyVoice2/3 on CPU, two-way calls.
# Build: docker build -t voicertc .   Run: docker compose up (compose.yaml: voicertc + coturn).
# tests/test_container.py lints this file and runs its steps (non-root start, healthcheck, port range).
FROM python:3.11-slim-bookworm

ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1

# libsndfile: soundfile; libgomp: torch and onnxruntime threads. Not pinned (DL3008): bookworm's
# security updates replace old versions, and the base tag already pins the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libsndfile1 libgomp1 \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 voicertc \
    && useradd --system --no-log-init --uid 10001 --gid 10001 --create-home --home-dir /home/voicertc voicertc \
    && mkdir -p /models /voices /etc/voicertc \
    && chown voicertc:voicertc /voices

WORKDIR /app
# torch from the CPU wheel index first, so the project's extras never pull a CUDA build
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY voicertc ./voicertc
COPY signaling ./signaling
COPY web ./web
RUN pip install -e ".[cpu-voice,cosyvoice,listen]"
COPY docker/config.toml /etc/voicertc/config.toml

USER 10001:10001
VOLUME ["/models", "/voices"]
EXPOSE 8080/tcp 50000-50100/udp
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "signaling.healthcheck", "--config", "/etc/voicertc/config.toml"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["voicertc", "serve"]
CMD ["--config", "/etc/voicertc/config.toml"]
