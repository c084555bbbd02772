"""The GGUF method's layers against their dequantized reference (kvloom's conformance kit),
for each GGML type with a writer: linear layers (plain and merged), the embedding and the
LM head, with int16 activations (the default) and int8 ones; plus the method's config
refusals."""

from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from kvloom_quant_gguf import GgufMethod
from kvloom_quant_gguf.writer import WRITABLE

from kvloom.testing.quantization import check_quantization_case, quantization_cases

#: Every type in float32 with int16 activations; one type of each kernel format also in
#: bfloat16 (converted to float32 at the kernels' door) and with int8 activations.
EACH_FORMAT = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0)


def _method(ggml_type: str, bits: int) -> GgufMethod:
    return GgufMethod({"quant_method": "gguf", "ggml_type": ggml_type, "activation_bits": bits})


CASES = [
    (t.name, bits, case)
    for t in WRITABLE
    for bits in ((16, 8) if t in EACH_FORMAT else (16,))
    for case in quantization_cases(
        _method(t.name, bits),
        (torch.float32, torch.bfloat16) if t in EACH_FORMAT and bits == 16 else (torch.float32,),
        input_multiple=GGML_QUANT_SIZES[t][0],
    )
]


@pytest.mark.parametrize(("ggml_type", "bits", "case"), CASES, ids=[f"{t}-int{b}-{c}" for t, b, c in CASES])
def test_conformance(ggml_type: str, bits: int, case) -> None:
    check_quantization_case(_method(ggml_type, bits), case)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"ggml_type": "Q9_9"}, "ggml_type: 'Q9_9' \\(allowed: Q4_0"),
        ({"ggml_type": "IQ2_XS"}, "has no format writer"),
        ({"ggml_type": 4}, "ggml_type: 4"),
        ({"activation_bits": 4}, "activation_bits \\(KVLOOM_GGUF_ACTIVATION_BITS\\): 4 \\(allowed: 8, 16\\)"),
    ],
)
def test_configs_it_does_not_run_are_refused_naming_the_field(config, message) -> None:
    with pytest.raises(ValueError, match=message):
        GgufMethod(config)
