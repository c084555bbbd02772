"""The latent widths FlashInfer's MLA kernels are built for, named once for the backend's
declarations (``mla_backend.py``, importable without ``flashinfer``) and the builder that
checks a model against them (``mla.py``)."""

#: (kv_lora_rank, qk_rope_head_dim) of DeepSeek-V2/V3: 512 + 64.
FLASHINFER_MLA_LATENT = (512, 64)
