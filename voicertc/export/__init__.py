"""Exports of a CosyVoice2 model directory for accelerated runtimes (`voicertc export vllm|onnx`).

- `vllm_export`: the speech LLM as a Hugging Face-format causal LM (`CosyVoice2ForCausalLM`) that
  transformers loads and vLLM serves through our plugin (`vllm_plugin`);
- `onnx_export`: the flow estimator in its streaming form (chunk + caches in, new caches out) and HiFT.

Nothing here is imported by the serving path unless an accelerated option asks for it.
"""
