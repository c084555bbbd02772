"""Testing tools shipped with kvloom, for kvloom's tests and for plugin authors' alike.

A plugin's tests import kvloom's user API (``from kvloom import LLM, SamplingParams,
EngineArgs``), ``kvloom.interfaces`` and ``kvloom.testing``; the names here are:

- the attention backend conformance suite (``kvloom.testing.conformance``: cases and
  usage patterns, CLI, Python, pytest): ``conformance_cases``, ``check_case``,
  ``run_case``, ``run_conformance``, ``ConformanceCase``, ``CaseResult``,
  ``ConformanceReport``, ``DEFAULT_TOLERANCES``;
- plugins in a test (``kvloom.testing.plugins``): ``fresh_plugins`` (load them afresh
  under the test's environment), ``installed_backend`` / ``active_platform`` (a class
  looks installed, or is the active platform), ``installed_quantization_methods`` (exactly
  these quantization methods look installed), ``select_attention_backend`` /
  ``report_attention_backends`` (what selection does, among given backend classes);
- the engine (``kvloom.testing.engine``): ``resolve_engine_config`` (the config the
  engine would run with), ``make_worker`` (a platform's worker as the engine builds it,
  handed kvloom's ``ModelRunner``), ``run_cli`` (the ``kvloom`` command in-process);
- models (``kvloom.testing.models``): ``load_model`` (a model class built and loaded as
  the engine does) and ``forward_context`` (run a model or ``Attention`` layer outside
  the engine);
- custom ops (``kvloom.testing.custom_ops``): ``custom_op_reference`` (the torch code a
  platform's custom op replaces), ``check_custom_op`` (hold a replacement to the
  contract: bit-identical, or within 2 ulp for the norms), ``lora_delta_reference`` and
  ``fused_moe_reference`` (the float64 definitions of the ``lora_delta`` and ``fused_moe`` ops).

Modules with more, imported on their own (``from kvloom.testing.models import
tiny_model_dir``; ``import kvloom.testing`` does not load them or their heavy
dependencies):

- ``kvloom.testing.models``: tiny random HF checkpoints with real tokenizers, made
  offline (``make_tiny_model``, ``tiny_model_dir``, ``save_tiny_checkpoint`` for any
  architecture, ``build_tokenizer``), HF transformers' greedy reference tokens
  (``hf_greedy_tokens``, with or without a LoRA adapter), ``random_prompts``;
- ``kvloom.testing.lora``: random PEFT LoRA adapters (``make_adapter``,
  ``edit_adapter_config``);
- ``kvloom.testing.install``: your distribution pip-installed into a directory
  (``install_distribution``), the environment of a ``kvloom`` subprocess that sees it
  (``plugin_env``), and ``kvloom serve`` for a ``with`` block (``KvloomServer``);
- ``kvloom.testing.reference``: the float64 reference attention over the paged layout and
  the random paged batches that tests and benchmarks check backends with;
- ``kvloom.testing.custom_ops``: the custom ops' references and the tolerances
  ``check_custom_op`` holds them to (``LORA_DELTA_TOLERANCES``, ``FUSED_MOE_TOLERANCES``,
  ``QK_NORM_ROTARY_TOLERANCES``, ...);
- ``kvloom.testing.host_sync``: detect host synchronisations in code meant for CUDA
  graphs;
- ``kvloom.testing.json_schema``: ``schema_errors`` (where a JSON value breaks a schema,
  for structured-output tests and benchmarks);
- ``kvloom.testing.face`` and ``.face_rules``: the plugin API's face read from the live
  modules and its record, ``kvloom/interfaces/face.json`` (``python -m kvloom.testing.face
  --write``), and the rules a change of it follows (docs/plugins.md, "Compatibility").
- ``kvloom.testing.quantization``: the quantization-method conformance kit
  (``quantization_cases``, ``check_quantization_case``, ``run_quantization_conformance``)
  and ``write_quantized_checkpoint`` (a tiny checkpoint in a method's format);
- ``kvloom.testing.quantization_reference``: HF transformers on dequantized weights with
  quantized activations (``hf_logits_quantized``, ``reference_fp8``,
  ``assert_greedy_matches_reference``).
"""

from kvloom.testing.conformance import (
    DEFAULT_TOLERANCES,
    CaseResult,
    ConformanceCase,
    ConformanceReport,
    check_case,
    conformance_cases,
    run_case,
    run_conformance,
)
from kvloom.testing.custom_ops import check_custom_op, custom_op_reference, fused_moe_reference, lora_delta_reference
from kvloom.testing.engine import ModelRunner, make_worker, resolve_engine_config, run_cli
from kvloom.testing.models import forward_context, load_model
from kvloom.testing.plugins import (
    active_platform,
    fresh_plugins,
    installed_backend,
    installed_quantization_methods,
    report_attention_backends,
    select_attention_backend,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "CaseResult",
    "ModelRunner",
    "ConformanceCase",
    "ConformanceReport",
    "active_platform",
    "check_case",
    "check_custom_op",
    "conformance_cases",
    "custom_op_reference",
    "forward_context",
    "fresh_plugins",
    "fused_moe_reference",
    "installed_backend",
    "installed_quantization_methods",
    "load_model",
    "lora_delta_reference",
    "make_worker",
    "report_attention_backends",
    "resolve_engine_config",
    "run_case",
    "run_cli",
    "run_conformance",
    "select_attention_backend",
]
