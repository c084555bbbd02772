"""Model sources, weights and tokenizers.

* ``model_source``: where a model comes from (HF directory, GGUF file, default SmolLM2)
  and its transformers config.
* ``model_loader.get_model(config, device)``: the model class from ``ModelRegistry``,
  built on the device in the run dtype, weights loaded (or dummy).
* ``weight_utils``: safetensors / ``.bin`` iterators and dummy weights.
* ``gguf_loader``: HF-named GGUF tensors, dequantized (with a dequantized-weight cache) or
  as stored for a quantization method that reads GGUF; ``gguf_header``: a GGUF
  file's metadata and tensor table; ``gguf_file``: its tensors as stored (``GGUFTensor``);
  ``gguf_metadata``: its content id, cache directory and HF config/tokenizer.
* ``tokenizer.get_tokenizer(model_config)``.
"""
