"""Model classes (Llama/Mistral, Qwen2, Qwen3) and ``ModelRegistry``.

Contract (docs/architecture.md, "Models"): ``Model(config, prefix="")``,
``forward(input_ids, positions) -> hidden``, ``compute_logits(hidden) -> logits`` (model dtype or float32),
``load_weights(iterable of (hf_name, tensor)) -> set of names loaded``.
"""
