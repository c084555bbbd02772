"""Models named by Hugging Face Hub id (``kvloom.loader.hub``), against a hub cache laid
out on disk (CI has no hub): ids, revisions, ``--download-dir``, tokenizer ids, GGUF ids
(``org/name:QUANT`` and ``org/name/file.gguf``), what is fetched online, and the errors
naming where kvloom looked."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest
from huggingface_hub import constants

from kvloom import LLM, SamplingParams
from kvloom.loader.hub import is_gguf_quant_type, parse_hub_reference
from kvloom.loader.model_source import load_hf_config, resolve_model_source
from tests.helpers.hf_cache import TINY_REPO as REPO
from tests.helpers.hf_cache import add_to_hf_cache, make_tiny_hub

GGUF_REPO = "kvloom-test/tiny-llama-GGUF"
TOKENIZER_REPO = "kvloom-test/tiny-tokenizer"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``make_tiny_hub``'s cache (REPO at main and at branch "other"), plus a
    tokenizer-only repository and a GGUF-only repository with two quantization types."""
    root = tmp_path_factory.mktemp("hub")
    hub = make_tiny_hub(root)
    main = hub["main_files"]
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(main / name, tokenizer / name)
    from tests.loader.test_gguf import write_tiny_gguf

    ggufs = root / "gguf"
    ggufs.mkdir()
    write_tiny_gguf(main, ggufs / "tiny-llama-Q8_0.gguf", "llama")
    shutil.copy(ggufs / "tiny-llama-Q8_0.gguf", ggufs / "tiny-llama-F16.gguf")
    hub["tokenizer"] = add_to_hf_cache(hub["cache"], TOKENIZER_REPO, tokenizer)
    hub["gguf"] = add_to_hf_cache(hub["cache"], GGUF_REPO, ggufs)
    return hub


@pytest.fixture
def offline(hub: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    """huggingface_hub offline, its cache the test's (as HF_HUB_OFFLINE=1 and HF_HUB_CACHE
    set it when the process starts)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub["cache"]))
    return hub["cache"]


@pytest.mark.parametrize("name,expected", [
    ("org/name", ("org/name", None, None)),
    ("gpt2", ("gpt2", None, None)),
    ("org/name:Q4_K_M", ("org/name", "Q4_K_M", None)),
    ("org/name:UD-Q4_K_XL", ("org/name", "UD-Q4_K_XL", None)),
    ("org/name/model-Q8_0.gguf", ("org/name", None, "model-Q8_0.gguf")),
    ("org/name/sub/model.gguf", ("org/name", None, "sub/model.gguf")),
    ("org/name:latest", None),  # not a quantization type
    ("./org/name", None),
    ("/models/m", None),
    ("~/m", None),
    ("org/name/extra", None),
    ("org--x/name", None),
])  # fmt: skip
def test_hub_references_as_vllm_names_them(name: str, expected: tuple | None) -> None:
    ref = parse_hub_reference(name)
    assert (ref and (ref.repo_id, ref.gguf_quant, ref.gguf_file)) == expected
    assert is_gguf_quant_type("q4_k_m") and is_gguf_quant_type("F16") and not is_gguf_quant_type("Q9_Z")


def test_hub_id_and_revision_found_offline(hub: dict[str, Path], offline: Path) -> None:
    source = resolve_model_source(REPO)
    assert (Path(source.path), source.kind, source.display_name) == (hub["main"], "hf", REPO)
    assert Path(source.tokenizer_path) == hub["main"]
    assert Path(resolve_model_source(REPO, revision="other").path) == hub["other"]
    commit = hub["other"].name
    assert Path(resolve_model_source(REPO, revision=commit).path) == hub["other"]
    assert load_hf_config(resolve_model_source(REPO, revision="other")).max_position_embeddings == 256


def test_download_dir_is_the_cache(hub: dict[str, Path], offline: Path, monkeypatch: pytest.MonkeyPatch,
                                   tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert Path(resolve_model_source(REPO, download_dir=str(hub["cache"])).path) == hub["main"]
    with pytest.raises(FileNotFoundError, match="elsewhere"):
        resolve_model_source(REPO)


def test_tokenizer_by_hub_id(hub: dict[str, Path], offline: Path) -> None:
    source = resolve_model_source(str(hub["other"]), tokenizer=TOKENIZER_REPO)
    assert Path(source.tokenizer_path) == hub["tokenizer"] and Path(source.path) == hub["other"].resolve()
    with pytest.raises(FileNotFoundError, match="revision 'v2'.*models--kvloom-test--tiny-tokenizer"):
        resolve_model_source(REPO, tokenizer=TOKENIZER_REPO, tokenizer_revision="v2")


def test_gguf_ids(hub: dict[str, Path], offline: Path) -> None:
    by_quant = resolve_model_source(f"{GGUF_REPO}:Q8_0")
    assert by_quant.kind == "gguf" and by_quant.path == str(hub["gguf"] / "tiny-llama-Q8_0.gguf")
    assert by_quant.display_name == f"{GGUF_REPO}:Q8_0" and by_quant.tokenizer_path == by_quant.path
    by_file = resolve_model_source(f"{GGUF_REPO}/tiny-llama-F16.gguf")
    assert by_file.path == str(hub["gguf"] / "tiny-llama-F16.gguf")
    # The cached file is a link to a blob without the .gguf suffix: the config is still read.
    assert load_hf_config(by_quant).model_type == "llama"
    with pytest.raises(FileNotFoundError, match=r"no GGUF file of quantization type Q4_K_M \(its GGUF files: "
                                                r"tiny-llama-F16.gguf, tiny-llama-Q8_0.gguf\)"):  # fmt: skip
        resolve_model_source(f"{GGUF_REPO}:Q4_K_M")
    with pytest.raises(FileNotFoundError, match=f"no config.json; its GGUF files: .* {GGUF_REPO}:QUANT_TYPE"):
        resolve_model_source(GGUF_REPO)


def test_missing_id_says_where_it_looked(hub: dict[str, Path], offline: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        resolve_model_source("kvloom-test/missing")
    message = str(info.value)
    assert str(hub["cache"] / "models--kvloom-test--missing") in message
    assert "HF_HUB_OFFLINE is set" in message and "revision 'main'" in message
    with pytest.raises(FileNotFoundError, match="revision 'nope'"):
        resolve_model_source(REPO, revision="nope")
    with pytest.raises(FileNotFoundError, match="neither an HF model directory nor a .gguf file, nor a Hugging Face"):
        resolve_model_source("./not/here")


def test_unreachable_hub_falls_back_on_the_cache(hub: dict[str, Path], offline: Path,
                                                 monkeypatch: pytest.MonkeyPatch, caplog) -> None:  # fmt: skip
    def no_network(self, repo_id: str, **kwargs) -> list[str]:
        raise ConnectionError("no route to host")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", no_network)
    assert Path(resolve_model_source(REPO).path) == hub["main"]
    with pytest.raises(FileNotFoundError, match="could not be reached .ConnectionError: no route to host"):
        resolve_model_source("kvloom-test/missing")


@pytest.mark.parametrize("load_format,expected", [
    ("auto", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]),
    ("pt", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "pytorch_model.bin"]),
    ("dummy", ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]),
])  # fmt: skip
def test_online_fetches_only_what_kvloom_loads(load_format: str, expected: list[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    remote = ["README.md", ".gitattributes", "config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
              "model.safetensors.index.json", "consolidated.safetensors", "pytorch_model.bin", "onnx/model.onnx",
              "original/params.json"]  # fmt: skip
    fetched: list[dict] = []

    def snapshot_download(repo_id: str, **kwargs) -> str:
        fetched.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, **kw: remote)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    (tmp_path / "config.json").write_text("{}")
    source = resolve_model_source(REPO, load_format, revision="v1", download_dir=str(tmp_path / "dl"))
    assert source.path == str(tmp_path.resolve())
    (call,) = fetched
    assert sorted(call.pop("allow_patterns")) == sorted(expected)
    assert call == {"revision": "v1", "cache_dir": str(tmp_path / "dl")}


def test_llm_by_hub_id_and_revision(hub: dict[str, Path], offline: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")
    llm = LLM(REPO, revision="other", dtype="float32", kv_cache_memory="8MiB", disable_log_stats=True)
    try:
        assert llm.config.model.served_model_name == REPO and llm.config.model.max_model_len == 256
        (out,) = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 3
    finally:
        llm.llm_engine.shutdown()
