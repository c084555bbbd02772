"""The plugin API's compatibility promise, kept by a test (docs/plugins.md, "Compatibility").

The live face (``kvloom.testing.face``) must equal its record (``kvloom/interfaces/face.json``),
and a change of the record must follow the rules of ``kvloom.testing.face_rules``: an addition
needs a new minor version, a removal or an incompatible change a new major version, a rename
keeps the old name as a deprecated alias for one minor version. The tests below apply
deliberately incompatible changes to copies of the live face (and to the live modules,
monkeypatched) and show that the check fails on them; then that a plugin written for plugin
API 1.0, reading a config field renamed since, runs with a deprecation warning.
"""

from __future__ import annotations

import ast
import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import ClassVar

import pytest

import kvloom.interfaces
import kvloom.interfaces.models
import kvloom.testing.face
from kvloom.deprecation import Deprecation, deprecated_attributes, reset_warnings_for_tests
from kvloom.plugins import PLUGIN_API_VERSION
from kvloom.testing.face import Face, live_face, main, read_record, stale_entries, write_record
from kvloom.testing.face_rules import compare_entries, rule_problems

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def live() -> Face:
    return live_face()


def without(entries: dict[str, str], path: str) -> dict[str, str]:
    """``entries`` with ``path`` and everything under it gone."""
    return {p: t for p, t in entries.items() if p != path and not p.startswith((path + ".", path + "["))}


def with_entry(entries: dict[str, str], path: str, text: str) -> dict[str, str]:
    return {**entries, path: text}


# ---------------------------------------------------------------------- the face and its record


def test_the_face_matches_its_record(live: Face) -> None:
    record = read_record()
    problems = rule_problems(record.entries, record.version, live.entries, live.version)
    assert not problems, "the plugin API's face changed against the rules:\n" + "\n".join(problems)
    stale = stale_entries(record, live)
    assert not stale, "the face record is out of date; run python -m kvloom.testing.face --write:\n" + "\n".join(stale)


def test_the_face_is_read(live: Face) -> None:
    # A reader that finds little would pass the comparison above.
    entries = live.entries
    assert len(entries) > 500
    for module in (kvloom.interfaces, kvloom.interfaces.models):
        prefix = module.__name__.removeprefix("kvloom.")
        missing = [n for n in module.__all__ if n != "PLUGIN_API_VERSION" and f"{prefix}.{n}" not in entries]
        assert not missing, missing
    assert entries["interfaces.AttentionBackend.get_kv_cache_shape"] == (
        "staticmethod(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]"
    )
    assert entries["interfaces.AttentionBackend.NAME"] == "attribute: ClassVar[str]"
    assert entries["interfaces.AttentionImpl.forward"].startswith("abstract method(query: Tensor, key: Tensor")
    assert entries["interfaces.Platform.check_and_update_config"] == "classmethod(config: EngineConfig) -> None"
    assert entries["interfaces.BackendCandidate.__init__"] == "constructor(name: str, provider: str) -> None"
    assert entries["interfaces.CUDAGraphMode.FULL"] == "member: 'FULL'"
    assert entries["interfaces.MLA_DECODE"] == "constant: 'decode'"
    assert entries["interfaces.models.EngineConfig"] == "same as interfaces.EngineConfig"
    assert entries["interfaces.EngineConfig"] == "config section: fields under config"
    assert entries["config.attention.backend"] == "field: type[AttentionBackend]"
    assert entries["config.scheduler.policy"] == "field: Literal['fcfs', 'priority']"
    assert entries["config.model.num_layers"] == "property: int"
    assert entries["config.attention_backend"] == "deprecated: use config.attention.backend; goes in 1.2"
    assert entries["runner.profile_peak_memory"] == "method(memory: DeviceMemory) -> int"
    assert entries["hooks.kvloom_update_engine_config"] == "hook(config: EngineConfig) -> None"
    assert entries["entry_points.kvloom.attention_backends"] == (
        "group: AttentionBackend subclass, unique names, entry-point name = its NAME"
    )


def test_the_record_is_one_entry_a_line() -> None:
    # Diff-friendly: a change of the face is a change of its lines.
    text = (ROOT / "core" / "kvloom" / "interfaces" / "face.json").read_text()
    record = json.loads(text)
    assert record["plugin_api_version"] == PLUGIN_API_VERSION
    assert len(text.splitlines()) == len(record["face"]) + 6
    assert list(record["face"]) == sorted(record["face"])


# ---------------------------------------------------------------------- deliberate changes


def test_a_removed_name_fails_unless_the_major_version_is_bumped(live: Face) -> None:
    old = live.entries
    new = without(old, "interfaces.Platform")
    problems = rule_problems(old, "1.0", new, "1.0")
    assert len(problems) == 1, problems  # the class once, not each of its members
    assert problems[0].startswith("interfaces.Platform (class(ABC)) was removed") and "2.0" in problems[0]
    assert rule_problems(old, "1.0", new, "1.1")  # a minor version may not remove
    assert rule_problems(old, "1.0", new, "2.0") == []


def test_a_removed_config_field_fails(live: Face) -> None:
    old = live.entries
    problems = rule_problems(old, "1.0", without(old, "config.attention.backend"), "1.1")
    assert len(problems) == 1 and problems[0].startswith("config.attention.backend (field: type[AttentionBackend])")


@pytest.mark.parametrize(
    "path, change, why",
    [
        ("interfaces.AttentionBackend.get_kv_cache_shape", (", head_size: int", ""), "'head_size' was removed"),
        ("interfaces.AttentionBackend.get_kv_cache_shape", ("num_kv_heads", "kv_heads"), "'num_kv_heads' moved"),
        ("interfaces.AttentionBackend.get_kv_cache_shape", ("head_size: int", "head_size: int, layer: int"),
         "new parameter 'layer' is required"),
        ("interfaces.AttentionImpl.forward", ("output: Tensor", "output: Tensor, scale: float = ..."),
         "abstract method"),
        ("interfaces.Platform.check_and_update_config", ("classmethod", "staticmethod"), "a classmethod became"),
        ("interfaces.AttentionMetadataBuilder.build_for_cudagraph_capture", ("method", "abstract method"),
         "became abstract"),
        ("interfaces.BackendCandidate.__init__", ("provider: str", "provider: str = ..., *, x: int"),
         "'x' is required"),
        ("interfaces.read_adapter_config", ("name: str | None = ...", "name: str | None"), "lost its default"),
        ("interfaces.MLA_DECODE", ("'decode'", "'dec'"), "its value changed"),
        ("interfaces.Worker", ("WorkerBase", "ABC"), "no longer derives from WorkerBase"),
        ("config.model.num_layers", ("property", "field"), "a property became a field"),
    ],
)  # fmt: skip
def test_an_incompatible_change_fails_unless_the_major_version_is_bumped(
    live: Face, path: str, change: tuple[str, str], why: str
) -> None:
    old = live.entries
    assert change[0] in old[path]
    new = with_entry(old, path, old[path].replace(*change, 1))
    for version in ("1.0", "1.1"):
        problems = rule_problems(old, "1.0", new, version)
        assert len(problems) == 1 and problems[0].startswith(path) and why in problems[0], problems
    assert rule_problems(old, "1.0", new, "2.0") == []


def test_an_addition_needs_a_minor_version(live: Face) -> None:
    old = live.entries
    new = with_entry(old, "interfaces.Platform.device_count", "classmethod() -> int")
    new = with_entry(new, "config.cache.swap_space", "field: int")
    problems = rule_problems(old, "1.0", new, "1.0")
    assert len(problems) == 1 and "make PLUGIN_API_VERSION 1.1" in problems[0]
    assert "interfaces.Platform.device_count" in problems[0] and "config.cache.swap_space" in problems[0]
    assert rule_problems(old, "1.0", new, "1.1") == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("method(x: int) -> None", "method(x: int, y: int = ...) -> None"),  # appended with a default
        ("method(x: int, *, y: int) -> None", "method(x: int, *, z: int = ..., y: int) -> None"),
        ("function(x: int, /) -> None", "function(value: int, /) -> None"),  # a positional-only name
        ("method(*, x: int) -> None", "method(x: int) -> None"),  # keyword-only -> positional-or-keyword
        ("abstract method(x: int) -> None", "method(x: int) -> None"),
        ("method(x: int) -> None", "method(x: int | None) -> bool"),  # types: the reviewer's word
        ("field: int", "field: int | None"),
        ("class(ABC)", "class(ABC, Generic)"),
        ("property: int", "property (settable): int"),
    ],
)
def test_compatible_changes_need_a_minor_version(old: str, new: str) -> None:
    assert compare_entries(old, new)[0], compare_entries(old, new)
    entries = {"interfaces.x": old}
    assert rule_problems(entries, "1.0", {"interfaces.x": new}, "1.0")
    assert rule_problems(entries, "1.0", {"interfaces.x": new}, "1.1") == []


def test_a_rename_keeps_the_old_name_as_a_deprecated_alias_for_one_minor_version(live: Face) -> None:
    old = live.entries
    renamed = with_entry(old, "interfaces.load_adapter_config", old["interfaces.read_adapter_config"])
    alias = "deprecated: use kvloom.interfaces.load_adapter_config; goes in {}"
    assert rule_problems(old, "1.0", without(renamed, "interfaces.read_adapter_config"), "1.1")  # no alias
    in_1_1 = with_entry(renamed, "interfaces.read_adapter_config", alias.format("1.2"))
    assert rule_problems(old, "1.0", in_1_1, "1.1") == []
    too_short = with_entry(renamed, "interfaces.read_adapter_config", alias.format("1.1"))
    assert "must stay until a later minor version" in rule_problems(old, "1.0", too_short, "1.1")[0]
    # The alias goes in the version it names, not before.
    gone = without(in_1_1, "interfaces.read_adapter_config")
    assert rule_problems(in_1_1, "1.1", gone, "1.2") == []
    early = rule_problems(in_1_1, "1.1", gone, "1.1")
    assert any("deprecated until plugin API 1.2" in p for p in early), early
    earlier = with_entry(in_1_1, "interfaces.read_adapter_config", alias.format("1.1"))
    assert any("removal moved earlier" in p for p in rule_problems(in_1_1, "1.1", earlier, "1.1"))


def test_a_version_older_than_the_record_fails(live: Face) -> None:
    assert "older than the record's 1.3" in rule_problems(live.entries, "1.3", live.entries, "1.2")[0]


# ---------------------------------------------------------------------- the live modules, changed


def test_a_monkeypatched_face_fails_the_check(live: Face, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvloom.interfaces, "__all__", [n for n in kvloom.interfaces.__all__ if n != "TPCommunicator"])

    def read_adapter_config(path: str) -> dict:  # `name` dropped
        return {}

    monkeypatch.setattr(kvloom.interfaces, "read_adapter_config", read_adapter_config)
    changed = live_face()
    problems = rule_problems(live.entries, live.version, changed.entries, live.version)
    assert len(problems) == 2, problems
    assert problems[0].startswith("interfaces.TPCommunicator (class) was removed")
    assert problems[1].startswith("interfaces.read_adapter_config: parameter 'name' was removed")


def test_a_deprecated_module_alias_is_recorded_and_warns_once(
    live: Face, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """How a name leaves ``kvloom.interfaces`` within a major version (the runner class will):
    ``deprecated_attributes`` serves the old name, warning once, and the face records it."""
    deprecation = Deprecation("kvloom.interfaces.OldCandidate", "kvloom.interfaces.BackendCandidate", goes_in="1.2")
    # The face's own aliases stay (the record has them); this test adds one.
    existing = vars(kvloom.interfaces)["__getattr__"].deprecations
    aliases = {name: (d, lambda: None) for name, d in existing.items()}
    aliases["OldCandidate"] = (deprecation, lambda: kvloom.interfaces.BackendCandidate)
    monkeypatch.setattr(
        kvloom.interfaces, "__getattr__", deprecated_attributes("kvloom.interfaces", aliases), raising=False
    )
    face = live_face()
    assert face.entries["interfaces.OldCandidate"] == (
        "deprecated: use kvloom.interfaces.BackendCandidate; goes in 1.2"
    )
    assert rule_problems(live.entries, "1.0", face.entries, "1.1") == []
    reset_warnings_for_tests()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, "kvloom.deprecation"):
        warnings.simplefilter("always")
        from kvloom.interfaces import OldCandidate  # noqa: F401  (the plugin's line)

        assert kvloom.interfaces.OldCandidate is kvloom.interfaces.BackendCandidate
    assert [str(w.message) for w in caught] == [deprecation.message()]
    assert caught[0].filename == __file__ and caplog.text.count("OldCandidate is deprecated") == 1
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        kvloom.interfaces.Nothing  # noqa: B018


# ---------------------------------------------------------------------- the tool


def test_the_tool_writes_only_what_the_rules_allow(
    live: Face, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = tmp_path / "face.json"
    write_record(live, record)
    assert main(["--record", str(record)]) == 0
    # A record with a name the live face lacks: the live face removed it.
    write_record(Face(live.version, with_entry(live.entries, "interfaces.gone", "function() -> None")), record)
    before = record.read_text()
    assert main(["--record", str(record), "--write"]) == 1
    assert "interfaces.gone (function() -> None) was removed" in capsys.readouterr().out
    assert record.read_text() == before
    # A record of 1.0 without a name, a kvloom of 1.1 with it: an addition in a new minor.
    monkeypatch.setattr(kvloom.testing.face, "PLUGIN_API_VERSION", "1.1")
    write_record(Face("1.0", without(live.entries, "interfaces.MLA_DECODE")), record)
    assert main(["--record", str(record)]) == 1
    assert "out of date" in capsys.readouterr().out
    assert main(["--record", str(record), "--write"]) == 0
    assert read_record(record) == Face("1.1", live.entries)


# ---------------------------------------------------------------------- renamed config fields


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvloom.testing.models import tiny_model_dir

    return tiny_model_dir("llama")


def test_renamed_config_fields_answer_with_one_warning_each(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    from kvloom.testing import resolve_engine_config

    config = resolve_engine_config(model=str(tiny_llama))
    reset_warnings_for_tests()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, "kvloom.deprecation"):
        warnings.simplefilter("always")
        for _ in range(2):  # the second read of each is silent
            assert config.attention_backend is config.attention.backend
            assert config.platform is config.device.platform
            assert config.attention.selected_backend == config.attention.backend.NAME
    messages = [str(w.message) for w in caught]
    assert all(w.category is DeprecationWarning and w.filename == __file__ for w in caught)
    assert messages == [
        f"{old} is deprecated: use {new}. kvloom plugin API 1.2 removes {old}."
        for old, new in [
            ("config.attention_backend", "config.attention.backend"),
            ("config.platform", "config.device.platform"),
            ("config.attention.selected_backend", "config.attention.backend.NAME"),
        ]
    ]
    assert [r.getMessage() for r in caplog.records] == messages


class PluginModelForCausalLM(kvloom.interfaces.models.LlamaForCausalLM):
    """A model plugin written for plugin API 1.0 (``KVLOOM_PLUGIN_API = "1.0"``), which kept
    the selected backend in ``config.attention_backend``."""

    backends_seen: ClassVar[list[type]] = []

    def __init__(self, config: kvloom.interfaces.EngineConfig, prefix: str = "") -> None:
        self.backends_seen.append(config.attention_backend)
        super().__init__(config, prefix)


def test_a_plugin_reading_config_attention_backend_runs_with_a_warning(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvloom import LLM, SamplingParams

    model_dir = tmp_path / "plugin-model"
    shutil.copytree(tiny_llama, model_dir)
    hf_config = json.loads((model_dir / "config.json").read_text())
    hf_config["architectures"] = ["PluginModelForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    monkeypatch.setitem(kvloom.interfaces.ModelRegistry._models, "PluginModelForCausalLM", PluginModelForCausalLM)
    monkeypatch.setenv("KVLOOM_ENABLE_MULTIPROCESSING", "0")  # the registration lives in this process
    reset_warnings_for_tests()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, "kvloom.deprecation"):
        warnings.simplefilter("always")
        llm = LLM(str(model_dir), dtype="float32", max_model_len=64, enforce_eager=True)
        plugin_out = llm.generate(
            [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False
        )
    assert len(plugin_out[0].outputs[0].token_ids) == 6
    assert PluginModelForCausalLM.backends_seen and PluginModelForCausalLM.backends_seen[-1].NAME
    assert [str(w.message).split(" is ")[0] for w in caught if w.category is DeprecationWarning] == [
        "config.attention_backend"
    ]
    assert "config.attention_backend is deprecated: use config.attention.backend" in caplog.text
