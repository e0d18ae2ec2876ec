"""CosyVoice2 and CosyVoice3 (Fun-CosyVoice3-0.5B): one package, parts as rooms, v2 and v3 side by side.

Floor plan (data flows down the list: text -> speech_tokens -> mel -> wav -> pcm):

    load/    an official model directory -> the networks      load(model_dir, device, dtype) picks v2/v3
             files.py (yaml once, tags, checkpoints, spk2info, the one dtype rule, CUDA switches),
             v2.py / v3.py (build), yaml_config.py, checkpoint.py (strict layouts)
    voice/   text and prompt audio -> what the LLM and flow need   (every function takes the model)
             text.py / text_v3.py (tokenizer, normalisation, sentence streams), features.py /
             features_v3.py (fbank, mel), onnx_frontends.py (speech tokenizer, CAM++), voices.py
             (Voice, VoiceBook, VoiceStore), voice_caches.py (prompt caches built on first use, bytes),
             text_prep.py (normalise + tokenise in spawned processes), frontend_checks.py (smoke-run)
    llm/     text tokens -> speech tokens (25 Hz)
             qwen2lm.py (v2) / v3.py, kv.py (SlotKV, KVSlot), batch.py (decode_batch), bistream.py
             (text deltas in), streamer.py (the LLM on another thread), graphs.py (CUDA-graph decode),
             ahead.py (a decode step launched before the one before is read), sampling.py (RAS),
             vllm/ (the vLLM runner, its model, plugin and RAS logits processor)
    flow/    speech tokens -> mel (causal CFM, chunk by chunk with caches)
             config.py / config_v3.py, flow.py (v2) / flow_v3.py, encoder.py, unet.py (v2 estimator),
             dit.py (v3 estimator), cfm.py (Euler solver with CFG), kv.py (growing K/V, rows appended
             together, two-segment attention),
             graph.py (the estimator with explicit caches: ONNX / TensorRT runners), captured.py /
             captured_encoder.py (the estimator and the token encoder as captured static-shape steps)
    hift/    mel -> wav (24 kHz)
             generator.py (v2 HiFT) / causal.py (v3 causal HiFT), source.py / source_causal.py
             (f0 -> excitation), stream.py (streaming state + the one chunk tail), batch.py (rows of
             equal length), overlap_add.py, weights.py
    serve/   the engine backend: utterances -> work units -> batches (engine thread)
             backend.py (CosyVoice2Backend, create_backend) / backend_v3.py (a small subclass),
             state.py (per-utterance state + the pure plan), token2wav.py / token2wav_v3.py (the
             streaming token -> PCM pipeline), streams.py (token2wav_stream for either), modes.py
             (LLM prompt per mode), device_lane.py (CUDA streams)
    accel/   the exporters and runners backends use: apply.py ([engine] estimator/compile),
             captured.py (StaticSteps: captured static-shape steps), compiled.py (inductor-compiled
             steps, sealed after warm-up),
             onnx_export.py + flow_onnx_export.py + hift_onnx_export.py, hift_ort.py, tensorrt_estimator.py,
             vllm_export.py

Rules: imports run down this list or sideways within a room, never up (tests/test_import_graph.py fails
on a new circle); `voicertc.export` holds only the commands (cli, doctor, measure, report);
`voicertc.assemble` (the composition root) is the only module that picks a backend.
`voicertc.backends.cosyvoice2` / `voicertc.backends.cosyvoice3` keep the public names of earlier releases
(`load`, the model classes) as re-exports.
"""
