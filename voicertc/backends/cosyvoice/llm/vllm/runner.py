"""`[engine] llm = "vllm"`: the speech LLM served by vLLM, tokens streamed to the engine worker.

NEVER RUN YET: vLLM has no CPU wheel, and the one GPU machine lent to this project had no vLLM (no
registry there). Its CPU-proven parts: the exported model (`voicertc export vllm`, transformers parity
test), RAS as a distribution (`ras_logits`), and the engine seam it plugs into (`llm_stream`: the same
streamer protocol as `llm = "thread"`, whose engine tests run everywhere).

- The model directory is exported once (`voicertc export vllm MODEL_DIR OUT`); the runner loads OUT with
  `skip_tokenizer_init` and `enable_prompt_embeds` (the architecture is registered by our plugin entry
  point, `voicertc.backends.cosyvoice.llm.vllm.plugin`).
- A prompt is passed as embeddings ([sos, text, task_id, prompt speech], from our `Qwen2LM.lm_input`).
- RAS runs as a V1 logits processor (`vllm_logits.RasLogitsProcessor`, loaded by name; its state,
  `ras_logits.RasRows`, is CPU-tested): it replaces each row's logits by the log of RAS's
  distribution, so vLLM's plain sampling (temperature 1, no top-k/top-p) draws as RAS does, and bans
  eos below the minimum length as the reference does (only 6561).
- One driver thread owns the vLLM engine: it waits on a condition while idle (no polling), steps while
  requests run, and hands every new token (None = finished) to the request's `sink`, which puts it on the
  engine worker's queue; the worker never waits on vLLM.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from voicertc.backends.cosyvoice.llm.sampling import SamplingParams

logger = logging.getLogger(__name__)

STOP_TOKEN_IDS = (6561, 6562, 6563)
TokenSink = Callable[[int | None | BaseException], None]  # `llm_stream.TokenSink`


@dataclass
class _Request:
    sink: TokenSink
    sent: int = 0


@dataclass
class VllmSpeechLlm:
    """Owns a vLLM engine on a driver thread; `submit` starts an utterance, `cancel` ends it."""

    model_path: str
    gpu_memory_utilization: float = 0.2
    dtype: str = "bfloat16"  # vLLM's fast attention backends do not serve float32
    max_model_len: int = 4096  # prompt + speech tokens of one segment, far below Qwen2's 32k
    ras: SamplingParams = field(default_factory=SamplingParams)  # the model yaml's llm.sampling
    _engine: Any = field(default=None, init=False, repr=False)
    _requests: dict[str, _Request] = field(default_factory=dict, init=False, repr=False)
    _pending: list[tuple[str, Any, Any]] = field(default_factory=list, init=False, repr=False)
    _cancelled: list[str] = field(default_factory=list, init=False, repr=False)
    _wake: threading.Condition = field(default_factory=threading.Condition, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _stopping: bool = field(default=False, init=False, repr=False)

    def start(self) -> None:
        from vllm import EngineArgs, LLMEngine

        from voicertc.backends.cosyvoice.llm.vllm.logits import LOGITS_PROCESSOR
        from voicertc.backends.cosyvoice.llm.vllm.plugin import register

        register()  # this process; vLLM's engine-core process registers through the entry point
        args = EngineArgs(
            model=self.model_path,
            skip_tokenizer_init=True,
            enable_prompt_embeds=True,
            dtype=self.dtype,
            max_model_len=self.max_model_len,
            gpu_memory_utilization=self.gpu_memory_utilization,
            logits_processors=[LOGITS_PROCESSOR],
        )
        self._engine = LLMEngine.from_engine_args(args)
        self._thread = threading.Thread(target=self._drive, name="vllm-driver", daemon=True)
        self._thread.start()

    def submit(
        self,
        request_id: str,
        prompt_embeds: torch.Tensor,
        min_len: int,
        max_len: int,
        sink: TokenSink,
        seed: int | None = None,
    ) -> None:
        """Queue an utterance: `prompt_embeds` [T, H] (our `lm_input` without the batch dim). A
        `llm_stream.SpeechTokenStreamer`: the engine's `[engine] llm = "vllm"`."""
        from vllm import SamplingParams as VllmSamplingParams

        params = VllmSamplingParams(
            temperature=1.0,
            top_k=-1,
            top_p=1.0,
            max_tokens=max_len,
            stop_token_ids=list(STOP_TOKEN_IDS),
            detokenize=False,
            extra_args={
                "ras": True,
                "min_len": min_len,
                "top_p": self.ras.top_p,
                "top_k": self.ras.top_k,
                "win_size": self.ras.win_size,
                "tau_r": self.ras.tau_r,
            },
            seed=seed,
        )
        prompt = {
            "prompt_embeds": prompt_embeds.to(
                torch.bfloat16 if self.dtype == "bfloat16" else prompt_embeds.dtype
            )
        }
        with self._wake:
            if self._stopping or self._thread is None or not self._thread.is_alive():
                raise RuntimeError("the vLLM runner is not running")
            self._requests[request_id] = _Request(sink)
            self._pending.append((request_id, prompt, params))
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        with self._wake:
            self._cancelled.append(request_id)
            self._wake.notify()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- driver thread ----------------------------------------------------------------------------

    def _drive(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # every waiting utterance fails with the cause, none waits forever
            logger.exception("vLLM driver crashed")
            for request in list(self._requests.values()):
                request.sink(exc)
            self._requests.clear()

    def _loop(self) -> None:
        engine = self._engine
        while True:
            with self._wake:
                while not (
                    self._stopping or self._pending or self._cancelled or engine.has_unfinished_requests()
                ):
                    self._wake.wait()
                if self._stopping:
                    return
                pending, self._pending = self._pending, []
                cancelled, self._cancelled = self._cancelled, []
            if cancelled:  # (ids are unique per segment: a cancelled one is never submitted again)
                engine.abort_request(cancelled)
                for request_id in cancelled:
                    self._requests.pop(request_id, None)
            for request_id, prompt, params in pending:
                if request_id not in cancelled:  # cancelled before vLLM saw it
                    engine.add_request(request_id, prompt, params)
            if engine.has_unfinished_requests():  # step() blocks on an idle engine core
                for output in engine.step():
                    self._deliver(output)

    def _deliver(self, output: Any) -> None:
        request = self._requests.get(output.request_id)
        if request is None:
            return
        tokens = list(output.outputs[0].token_ids)
        for token in tokens[request.sent :]:
            if token not in STOP_TOKEN_IDS:
                request.sink(int(token))
        request.sent = len(tokens)
        if output.finished:
            self._requests.pop(output.request_id, None)
            request.sink(None)
