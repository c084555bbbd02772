"""Quantized checkpoints: the quantization-method plugin contract, its selection, and the
quantization of the model being built.

* ``method``: ``QuantizationMethod`` (what a method declares, ``validate``,
  ``layer_method``), ``LayerKind``, ``LayerInfo``, ``QuantizationSelectorConfig``;
* ``layer_methods``: what a method does for one layer (``LinearQuantMethod``,
  ``FusedMoEQuantMethod``, ``EmbeddingQuantMethod``) and how its parameters follow the
  weight (``ParamLayout``, ``add_quantized_parameter``);
* ``selection``: which installed method runs a checkpoint (``resolve_quantization``);
* ``context``: how layers find their method while the model is built
  (``building_model``, ``layer_quant_method``, ``process_weights_after_loading``).

Methods are plugins (entry-point group ``kvloom.quantization_methods``); kvloom's own are
the distributions ``kvloom-quant-fp8`` and ``kvloom-quant-compressed-tensors``
(``docs/quantization.md``).
"""
