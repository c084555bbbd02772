"""Real tokenizers for the detokenizer / output processor tests (this module has no tests).

* ``byte_level_tokenizer``: a GPT-2-style byte-level BPE trained offline with ``tokenizers``;
* ``sentencepiece_style_tokenizer``: a Llama-style BPE with byte fallback and "▁" spaces
  (the decoder drops the leading space of the first token, like sentencepiece);
* ``smollm2_tokenizer``: the default model's tokenizer (from its GGUF, cached on disk).
"""

from __future__ import annotations

import functools
import json

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

CORPUS = [
    "Hello world, this is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "Stop strings end a request; stop token ids are kept.",
] * 10

#: Text with multi-byte characters (accents, CJK, emoji incl. a ZWJ sequence) that
#: byte-level tokenizers split across tokens.
HARD_TEXTS = [
    "Hello 日本語 and 世界! 🌍🎉 done.",
    "café naïve façade — “quoted” ½ ∑ 𝔘𝔫𝔦",
    "👩‍👩‍👧 family, 🇫🇷 flag, 한국어 텍스트, Ελληνικά, עברית",
    "plain ascii text only, with numbers 12345.",
]


@functools.lru_cache(maxsize=None)
def byte_level_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@functools.lru_cache(maxsize=None)
def sentencepiece_style_tokenizer():
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Put the 256 byte-fallback tokens <0x00>..<0xFF> right after the specials, as
    # sentencepiece models do.
    spec = json.loads(tok.to_str())
    vocab = {t: i for i, t in enumerate(specials)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t in sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get):
        vocab.setdefault(t, len(vocab))
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from kvloom.loader.model_source import default_model_path, gguf_hf_dir

    return AutoTokenizer.from_pretrained(gguf_hf_dir(default_model_path()))


ALL_TOKENIZERS = {
    "byte_level": byte_level_tokenizer,
    "sentencepiece_style": sentencepiece_style_tokenizer,
    "smollm2": smollm2_tokenizer,
}
