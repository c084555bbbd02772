#!/usr/bin/env python3
"""How close HF transformers' own bf16 greedy run is to its fp32 reference on SmolLM2.

The yardstick for kvloom's bf16 top-1 agreement (tests/gpu/test_e2e_gpu.py): 8 chat
prompts, 128 greedy bf16 tokens each, teacher-forced through the fp32 model; the share of
tokens the fp32 model ranks first. Runs on the CPU (slow: bf16 matmuls without native
support, ~2 minutes with one thread).

    python benchmarks/hf_bf16_agreement.py
"""
import torch, time
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvloom.loader.model_source import default_model_path, gguf_hf_dir
torch.set_num_threads(1)
p = default_model_path()
tok = AutoTokenizer.from_pretrained(gguf_hf_dir(p))
qs = ["What is the capital of France?", "Write a haiku about the sea.", "Explain how a bicycle stays upright.",
      "List three uses of copper.", "Why is the sky blue?", "Give me a recipe for pancakes.", "What does a compiler do?",
      "Tell me a short story about a robot who learns to paint."]
prompts = [list(tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids) for q in qs]
m16 = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.bfloat16).eval()
m32 = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
agree = total = 0
t = time.time()
with torch.no_grad():
    for pr in prompts:
        ids = torch.tensor([pr])
        g = m16.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(pr):].tolist()
        pred = m32(torch.tensor([pr + g])).logits[0, len(pr) - 1 : len(pr) + len(g) - 1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(pred, g)); total += len(g)
        print(f"{agree}/{total} = {agree/total:.4f} ({time.time()-t:.0f}s)", flush=True)
print(f"HF bf16 greedy vs HF fp32 reference, top-1 agreement: {agree/total:.4f} over {total} tokens")
