"""Plugin loading policy, in-process: fake distributions written as dist-info directories.

``FakeSite`` writes modules and ``*.dist-info`` directories (METADATA +
entry_points.txt) into a temporary directory, what pip would leave behind, and reads the
entry points back with ``importlib.metadata``, so they carry real distribution names and
versions. Nothing is installed into the test environment. (The same behaviour through
real ``pip install``s and the ``kvloom`` CLI is in test_registry_install.py.)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap
from collections.abc import Iterator, Mapping
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvloom_registry as registry
from kvloom import plugins as state
from kvloom.attention.selector import get_attention_backend
from kvloom.lora.resolver import _LoRAResolverRegistry
from kvloom.models.registry import _ModelRegistry
from kvloom.plugins import (
    ATTENTION_BACKENDS,
    GENERAL_PLUGINS,
    GROUPS,
    IO_PROCESSOR_PLUGINS,
    LORA_RESOLVERS,
    PLATFORM_PLUGINS,
    PLUGIN_API_VERSION,
    STAT_LOGGER_PLUGINS,
    run_general_plugins,
)
from kvloom_registry import HookPlugins, LoadedPlugins, load_entry_points, parse_allowlist

API = 'KVLOOM_PLUGIN_API = "1.0"\n'
HOOKS = API + "from kvloom.interfaces import hookimpl\n"


class FakeSite:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def add(
        self,
        distribution: str,
        modules: Mapping[str, str],
        entry_points: Mapping[str, Mapping[str, str]],
        version: str = "1.0",
    ) -> None:
        """Add a distribution; ``modules`` maps a top-level module name to its source."""
        for name, source in modules.items():
            (self.root / f"{name}.py").write_text(textwrap.dedent(source))
            self.modules.append(name)
        info = self.root / f"{distribution.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
        lines = []
        for group, eps in entry_points.items():
            lines.append(f"[{group}]")
            lines += [f"{name} = {value}" for name, value in eps.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()

    def entry_points(self) -> dict[str, list[EntryPoint]]:
        by_group: dict[str, list[EntryPoint]] = {}
        for dist in importlib.metadata.distributions(path=[str(self.root)]):
            for ep in dist.entry_points:
                by_group.setdefault(ep.group, []).append(ep)
        return by_group


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSite]:
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    fake = FakeSite(root)
    yield fake
    for name in fake.modules:
        sys.modules.pop(name, None)


def backend_source(name: str) -> str:
    """A complete (trivial) CPU backend module whose class ``Backend`` has NAME ``name``."""
    return API + textwrap.dedent(
        f"""
        import torch
        from kvloom.interfaces import AttentionBackend, AttentionImpl, AttentionMetadataBuilder

        class Impl(AttentionImpl):
            def forward(self, query, key, value, kv_cache, attn_metadata, output):
                raise RuntimeError("selection tests never run attention")

        class Builder(AttentionMetadataBuilder):
            def build(self, common):
                return common

        class Backend(AttentionBackend):
            NAME = "{name}"
            supported_dtypes = (torch.float32,)
            supported_device_types = ("cpu",)

            @staticmethod
            def get_impl_cls():
                return Impl

            @staticmethod
            def get_builder_cls():
                return Builder

            @staticmethod
            def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size):
                return (2, num_blocks, block_size, num_kv_heads, head_size)
        """
    )


def add_backend(
    site: FakeSite, distribution: str, module: str, name: str, *, source: str | None = None,
    entry_point: str | None = None, version: str = "1.0",
) -> None:
    """A distribution with one backend: entry point ``entry_point or name`` -> ``module:Backend``."""
    site.add(
        distribution,
        {module: source if source is not None else backend_source(name)},
        {ATTENTION_BACKENDS: {entry_point or name: f"{module}:Backend"}},
        version=version,
    )


def add_plugin(site: FakeSite, distribution: str, group: str, name: str, module: str, source: str,
               attr: str | None = None, version: str = "1.0") -> None:
    """A distribution with one plugin: entry point ``name`` -> ``module[:attr]``."""
    site.add(distribution, {module: source}, {group: {name: f"{module}:{attr}" if attr else module}}, version=version)


def load(site: FakeSite, allowlist: str | None = None) -> LoadedPlugins:
    return load_entry_points(GROUPS, site.entry_points(), parse_allowlist(allowlist), PLUGIN_API_VERSION)


# ---------------------------------------------------------------------- policy


def test_parse_allowlist() -> None:
    assert parse_allowlist(None) is None
    assert parse_allowlist("") == frozenset()
    assert parse_allowlist(" a, b ,,c ") == frozenset({"a", "b", "c"})


def test_loads_backend_with_distribution_and_version(site: FakeSite) -> None:
    add_backend(site, "fake-backend", "fake_backend_a", "FAKE_A", version="2.3.1")
    plugins = load(site)
    entry = plugins.by_name(ATTENTION_BACKENDS)["FAKE_A"]
    assert (entry.target.NAME, entry.distribution, entry.version) == ("FAKE_A", "fake-backend", "2.3.1")


def test_allowlist_filters_and_records_excluded(site: FakeSite) -> None:
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A")
    add_backend(site, "fake-b", "fake_backend_b", "FAKE_B")
    plugins = load(site, "FAKE_B")
    assert list(plugins.by_name(ATTENTION_BACKENDS)) == ["FAKE_B"]
    assert [e.name for e in plugins.excluded[ATTENTION_BACKENDS]] == ["FAKE_A"]
    assert "fake_backend_a" not in sys.modules  # an excluded plugin is never imported
    none = load(site, "")
    assert none.group(ATTENTION_BACKENDS) == [] and len(none.excluded[ATTENTION_BACKENDS]) == 2


def test_allowlisted_name_not_installed_is_an_error(site: FakeSite) -> None:
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A")
    with pytest.raises(registry.PluginAllowlistError) as e:
        load(site, "FAKE_A,NOT_THERE")
    assert "NOT_THERE" in str(e.value) and "Installed plugins: FAKE_A" in str(e.value)


def test_plugin_raising_on_import_is_reported_with_traceback(site: FakeSite) -> None:
    source = API + "def helper():\n    raise KeyError('missing setting')\nhelper()\n"
    add_plugin(site, "fake-broken", GENERAL_PLUGINS, "broken", "fake_broken", source, "register", version="0.9")
    with pytest.raises(registry.PluginLoadError) as e:
        load(site)
    err = e.value
    assert (err.plugin, err.group, err.distribution) == ("broken", GENERAL_PLUGINS, "fake-broken")
    message = str(err)
    assert "'broken'" in message and "fake-broken 0.9" in message and "kvloom.general_plugins" in message
    assert "Traceback" in message and "in helper" in message and "missing setting" in message


def test_missing_attribute_is_reported(site: FakeSite) -> None:
    add_plugin(site, "fake-a", ATTENTION_BACKENDS, "FAKE_A", "fake_backend_a", backend_source("FAKE_A"), "Nope")
    with pytest.raises(registry.PluginLoadError, match="has no attribute 'Nope'"):
        load(site)


# ---------------------------------------------------------------------- API version


def test_missing_api_declaration_tells_author_what_to_add(site: FakeSite) -> None:
    source = backend_source("FAKE_A").replace(API, "")
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A", source=source)
    with pytest.raises(registry.PluginAPIVersionError) as e:
        load(site)
    assert f'KVLOOM_PLUGIN_API = "{PLUGIN_API_VERSION}"' in str(e.value) and "fake_backend_a" in str(e.value)


@pytest.mark.parametrize("declared", ["2.0", "0.9"])
def test_other_major_version_is_refused_naming_both(site: FakeSite, declared: str) -> None:
    source = backend_source("FAKE_A").replace('"1.0"', f'"{declared}"')
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A", source=source)
    with pytest.raises(registry.PluginAPIVersionError) as e:
        load(site)
    assert f"plugin API {declared}" in str(e.value) and f"plugin API {PLUGIN_API_VERSION}" in str(e.value)
    assert "fake-a" in str(e.value)


def test_malformed_api_version_is_refused(site: FakeSite) -> None:
    source = backend_source("FAKE_A").replace('"1.0"', "1.0")  # a float, not a string
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A", source=source)
    with pytest.raises(registry.PluginAPIVersionError, match="MAJOR.MINOR"):
        load(site)


def _declaring(version: str) -> str:
    return backend_source("FAKE_A").replace('"1.0"', f'"{version}"')


def test_newer_minor_version_is_refused_by_name(site: FakeSite) -> None:
    # A plugin written for 1.3 may use what 1.2 and 1.3 added: refused at load, by name,
    # instead of failing later on a missing name.
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A", source=_declaring("1.3"), version="0.4")
    with pytest.raises(registry.PluginAPIVersionError) as e:
        load_entry_points(GROUPS, site.entry_points(), None, "1.1")
    message = str(e.value)
    assert "plugin 'FAKE_A'" in message and "fake-a 0.4" in message
    assert "written for kvloom plugin API 1.3; this kvloom provides plugin API 1.1" in message
    assert "Upgrade kvloom" in message


def test_the_next_minor_of_this_kvloom_is_refused(site: FakeSite) -> None:
    major, minor = PLUGIN_API_VERSION.split(".")
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A", source=_declaring(f"{major}.{int(minor) + 1}"))
    with pytest.raises(registry.PluginAPIVersionError, match=f"this kvloom provides plugin API {PLUGIN_API_VERSION}"):
        load(site)


@pytest.mark.parametrize("declared", ["1.0", "1.2", "1.3"])
def test_an_older_or_equal_minor_version_loads(site: FakeSite, declared: str) -> None:
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A", source=_declaring(declared))
    plugins = load_entry_points(GROUPS, site.entry_points(), None, "1.3")
    assert plugins.by_name(ATTENTION_BACKENDS)["FAKE_A"].target.NAME == "FAKE_A"


# ---------------------------------------------------------------------- names and types


def test_two_backends_with_one_name_name_both_distributions(site: FakeSite) -> None:
    add_backend(site, "first-dist", "fake_backend_a", "SAME")
    add_backend(site, "second-dist", "fake_backend_b", "SAME")
    with pytest.raises(registry.DuplicatePluginError) as e:
        load(site)
    assert "first-dist" in str(e.value) and "second-dist" in str(e.value) and "'SAME'" in str(e.value)


def test_duplicate_names_left_out_by_the_allowlist_do_not_conflict(site: FakeSite) -> None:
    add_backend(site, "first-dist", "fake_backend_a", "SAME")
    add_backend(site, "second-dist", "fake_backend_b", "SAME")
    add_backend(site, "third-dist", "fake_backend_c", "OTHER")
    assert list(load(site, "OTHER").by_name(ATTENTION_BACKENDS)) == ["OTHER"]


def test_entry_point_name_must_equal_backend_name(site: FakeSite) -> None:
    add_backend(site, "fake-a", "fake_backend_a", "REAL_NAME", entry_point="OTHER_NAME")
    with pytest.raises(registry.PluginLoadError, match="NAME is 'REAL_NAME'"):
        load(site)


def test_many_out_of_tree_backends_coexist(site: FakeSite) -> None:
    for i in range(4):
        add_backend(site, f"fake-{i}", f"fake_backend_{i}", f"FAKE_{i}")
    assert sorted(load(site).by_name(ATTENTION_BACKENDS)) == ["FAKE_0", "FAKE_1", "FAKE_2", "FAKE_3"]


def test_stat_logger_must_subclass_stat_logger_base(site: FakeSite) -> None:
    source = API + "class NotALogger:\n    pass\n"
    add_plugin(site, "fake-stats", STAT_LOGGER_PLUGINS, "bad_logger", "fake_stats", source, "NotALogger")
    with pytest.raises(TypeError) as e:
        load(site)
    assert "bad_logger" in str(e.value) and "NotALogger" in str(e.value) and "StatLoggerBase" in str(e.value)


def test_abstract_backend_is_refused(site: FakeSite) -> None:
    source = API + "from kvloom.interfaces import AttentionBackend\n"
    source += "class Backend(AttentionBackend):\n    NAME = 'HALF'\n"
    add_backend(site, "fake-half", "fake_half", "HALF", source=source)
    with pytest.raises(TypeError, match="get_builder_cls, get_impl_cls, get_kv_cache_shape"):
        load(site)


def test_platform_io_processor_and_stat_logger_targets(site: FakeSite) -> None:
    source = API + textwrap.dedent(
        """
        from kvloom.interfaces import BackendCandidate, IOProcessor, Platform, StatLoggerBase

        class FakePlatform(Platform):
            name = "fake_platform"
            device_type = "cpu"
            @classmethod
            def is_available(cls):
                return True
            @classmethod
            def get_attn_backend_priority(cls, use_mla, capability):
                return [BackendCandidate("FAKE_A", "fake-a")]
            @classmethod
            def get_worker_cls(cls):
                raise NotImplementedError

        class Processor(IOProcessor):
            def parse_data(self, data):
                return data
            def pre_process(self, prompt, request_id=None, **kwargs):
                return prompt
            def post_process(self, model_output, request_id=None, **kwargs):
                return model_output

        class Logger(StatLoggerBase):
            def record(self, scheduler_stats, iteration_stats, engine_idx=0):
                pass
        """
    )
    site.add(
        "fake-kinds",
        {"fake_kinds": source},
        {
            PLATFORM_PLUGINS: {"fake_platform": "fake_kinds:FakePlatform"},
            IO_PROCESSOR_PLUGINS: {"fake_io": "fake_kinds:Processor"},
            STAT_LOGGER_PLUGINS: {"fake_logger": "fake_kinds:Logger"},
        },
    )
    plugins = load(site)
    assert plugins.by_name(PLATFORM_PLUGINS)["fake_platform"].target.__name__ == "FakePlatform"
    assert plugins.by_name(IO_PROCESSOR_PLUGINS)["fake_io"].target.__name__ == "Processor"
    assert [e.target.__name__ for e in plugins.group(STAT_LOGGER_PLUGINS)] == ["Logger"]


def test_platform_entry_point_name_must_equal_platform_name(site: FakeSite) -> None:
    source = API + textwrap.dedent(
        """
        from kvloom.interfaces import Platform
        class P(Platform):
            name = "real"
            device_type = "cpu"
            @classmethod
            def is_available(cls):
                return True
            @classmethod
            def get_attn_backend_priority(cls, use_mla, capability):
                return []
            @classmethod
            def get_worker_cls(cls):
                raise NotImplementedError
        """
    )
    add_plugin(site, "fake-p", PLATFORM_PLUGINS, "alias", "fake_p", source, "P")
    with pytest.raises(registry.PluginLoadError, match="name is 'real'"):
        load(site)


# ---------------------------------------------------------------------- general plugins


def run_general(site: FakeSite) -> tuple[HookPlugins, _ModelRegistry, _LoRAResolverRegistry]:
    plugins = load(site)
    models, resolvers = _ModelRegistry(), _LoRAResolverRegistry()
    general = run_general_plugins(plugins.group(GENERAL_PLUGINS), models, resolvers)
    return general, models, resolvers


HOOKS_SOURCE = API + textwrap.dedent(
    """
    from kvloom.interfaces import LoRAResolver, hookimpl

    class NullResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name, lora_name):
            return None

    @hookimpl
    def kvloom_register_models(model_registry):
        model_registry.register_model("HookArchForCausalLM", "kvloom.models.llama:LlamaForCausalLM")

    @hookimpl
    def kvloom_register_lora_resolvers(resolver_registry):
        resolver_registry.register_resolver("null", NullResolver())

    @hookimpl
    def kvloom_update_engine_config(config):
        config.scheduler.max_num_seqs = 7
    """
)


def test_general_register_function_and_hook_module(site: FakeSite) -> None:
    register_source = API + textwrap.dedent(
        """
        from kvloom import ModelRegistry
        CALLS = []
        def register():
            CALLS.append(1)
        """
    )
    site.add(
        "fake-general",
        {"fake_general_fn": register_source, "fake_general_hooks": HOOKS_SOURCE},
        {GENERAL_PLUGINS: {"fn": "fake_general_fn:register", "hooks": "fake_general_hooks"}},
    )
    general, models, resolvers = run_general(site)
    assert sys.modules["fake_general_fn"].CALLS == [1]
    assert models.is_supported("HookArchForCausalLM")
    assert resolvers.get_supported_resolvers() == ["null"]
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=256))
    general.call_hook("kvloom_update_engine_config", config=config)
    assert config.scheduler.max_num_seqs == 7


def test_general_hook_class_is_instantiated(site: FakeSite) -> None:
    source = API + textwrap.dedent(
        """
        from kvloom.interfaces import hookimpl
        class Hooks:
            def __init__(self):
                self.arch = "ClassArchForCausalLM"
            @hookimpl
            def kvloom_register_models(self, model_registry):
                model_registry.register_model(self.arch, "kvloom.models.llama:LlamaForCausalLM")
        """
    )
    add_plugin(site, "fake-class", GENERAL_PLUGINS, "cls", "fake_class_hooks", source, "Hooks")
    _, models, _ = run_general(site)
    assert models.is_supported("ClassArchForCausalLM")


def test_misspelt_hook_fails_loudly(site: FakeSite) -> None:
    source = HOOKS + "@hookimpl\ndef kvloom_register_model(model_registry):\n    pass\n"
    add_plugin(site, "fake-typo", GENERAL_PLUGINS, "typo", "fake_typo", source)
    with pytest.raises(registry.PluginLoadError) as e:
        run_general(site)
    assert "typo" in str(e.value) and "kvloom_register_model" in str(e.value)


def test_misspelt_hook_argument_fails_loudly(site: FakeSite) -> None:
    source = HOOKS + "@hookimpl\ndef kvloom_register_models(registry):\n    pass\n"
    add_plugin(site, "fake-arg", GENERAL_PLUGINS, "badarg", "fake_arg", source)
    with pytest.raises(registry.PluginLoadError, match="registry"):
        run_general(site)


def test_hook_without_marker_fails_loudly(site: FakeSite) -> None:
    source = HOOKS + "@hookimpl\ndef kvloom_register_models(model_registry):\n    pass\n"
    source += "def kvloom_update_engine_config(config):\n    pass\n"
    add_plugin(site, "fake-nomark", GENERAL_PLUGINS, "nomark", "fake_nomark", source)
    with pytest.raises(registry.PluginLoadError, match="kvloom_update_engine_config lack the @kvloom.interfaces.hookim"):
        run_general(site)


def test_module_without_hooks_fails_loudly(site: FakeSite) -> None:
    add_plugin(site, "fake-empty", GENERAL_PLUGINS, "empty", "fake_empty", API + "def register():\n    pass\n")
    with pytest.raises(registry.PluginLoadError, match="no @kvloom.interfaces.hookimpl functions"):
        run_general(site)


def test_register_raising_names_the_plugin(site: FakeSite) -> None:
    source = API + "def register():\n    raise ValueError('cannot register')\n"
    add_plugin(site, "fake-raise", GENERAL_PLUGINS, "raiser", "fake_raise", source, "register")
    with pytest.raises(registry.PluginLoadError) as e:
        run_general(site)
    assert "raiser" in str(e.value) and "fake-raise" in str(e.value) and "cannot register" in str(e.value)


def test_hook_raising_names_the_plugin(site: FakeSite) -> None:
    source = HOOKS + "@hookimpl\ndef kvloom_register_models(model_registry):\n    raise RuntimeError('hook broke')\n"
    add_plugin(site, "fake-hookraise", GENERAL_PLUGINS, "hookraiser", "fake_hookraise", source)
    with pytest.raises(registry.PluginLoadError) as e:
        run_general(site)
    message = str(e.value)
    assert "hookraiser" in message and "kvloom_register_models" in message and "hook broke" in message


# ---------------------------------------------------------------------- process state


def use_site(monkeypatch: pytest.MonkeyPatch, site: FakeSite) -> None:
    eps = site.entry_points()
    monkeypatch.setattr(state, "installed_entry_points", lambda groups: {g.name: eps.get(g.name, []) for g in groups})


def test_load_plugins_is_idempotent_and_registers_lora_resolvers(
    site: FakeSite, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    counter_source = API + "CALLS = []\ndef register():\n    CALLS.append(1)\n"
    resolver_source = API + textwrap.dedent(
        """
        from kvloom.interfaces import LoRAResolver
        class Resolver(LoRAResolver):
            async def resolve_lora(self, base_model_name, lora_name):
                return None
        """
    )
    site.add(
        "fake-state",
        {"fake_counter": counter_source, "fake_resolver": resolver_source, "fake_backend_a": backend_source("FAKE_A")},
        {
            GENERAL_PLUGINS: {"counter": "fake_counter:register"},
            LORA_RESOLVERS: {"fake_resolver": "fake_resolver:Resolver"},
            ATTENTION_BACKENDS: {"FAKE_A": "fake_backend_a:Backend"},
        },
    )
    use_site(monkeypatch, site)
    state.load_plugins()
    state.load_plugins()
    assert sys.modules["fake_counter"].CALLS == [1]  # register() ran once per process
    from kvloom.lora.resolver import LoRAResolverRegistry

    assert LoRAResolverRegistry.get_supported_resolvers() == ["fake_resolver"]
    assert get_attention_backend("FAKE_A").NAME == "FAKE_A"
    with pytest.raises(ValueError, match="Valid names: FAKE_A"):
        get_attention_backend("NOPE")


def test_a_failed_load_keeps_failing(site: FakeSite, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None) -> None:
    source = API + "raise OSError('no device file')\n"
    add_plugin(site, "fake-broken", GENERAL_PLUGINS, "broken2", "fake_broken2", source, "register")
    use_site(monkeypatch, site)
    for _ in range(2):
        with pytest.raises(registry.PluginLoadError, match="no device file"):
            state.load_plugins()
    with pytest.raises(registry.PluginLoadError):
        state.attention_backends()
    # Excluding the broken plugin (after a reset) makes the process usable.
    monkeypatch.setenv("KVLOOM_PLUGINS", "")
    state.reset_for_tests()
    assert state.attention_backends() == {}


def test_io_processor_and_stat_logger_accessors(
    site: FakeSite, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    source = API + textwrap.dedent(
        """
        from kvloom.interfaces import IOProcessor, StatLoggerBase
        class Processor(IOProcessor):
            def parse_data(self, data):
                return data
            def pre_process(self, prompt, request_id=None, **kwargs):
                return prompt
            def post_process(self, model_output, request_id=None, **kwargs):
                return model_output
        class Logger(StatLoggerBase):
            def record(self, scheduler_stats, iteration_stats, engine_idx=0):
                pass
        """
    )
    site.add(
        "fake-acc",
        {"fake_acc": source},
        {IO_PROCESSOR_PLUGINS: {"proc": "fake_acc:Processor"}, STAT_LOGGER_PLUGINS: {"log": "fake_acc:Logger"}},
    )
    use_site(monkeypatch, site)
    assert state.get_io_processor_cls("proc").__name__ == "Processor"
    assert [e.target.__name__ for e in state.stat_logger_plugins()] == ["Logger"]
    with pytest.raises(ValueError, match="installed: proc"):
        state.get_io_processor_cls("missing")


def test_endpoint_plugins_load_only_when_the_allowlist_names_them(site: FakeSite) -> None:
    from kvloom.plugins import ENDPOINT_PLUGINS

    source = API + textwrap.dedent(
        """
        from fastapi import APIRouter
        from kvloom.interfaces import EndpointPlugin

        class Hello(EndpointPlugin):
            name = "hello"

            def router(self):
                return APIRouter()
        """
    )
    add_plugin(site, "fake-endpoint", ENDPOINT_PLUGINS, "hello", "fake_endpoint", source, attr="Hello")
    add_backend(site, "fake-a", "fake_backend_a", "FAKE_A")
    everything = load(site)  # KVLOOM_PLUGINS unset: every other kind loads, endpoint plugins do not
    assert everything.group(ENDPOINT_PLUGINS) == [] and [e.name for e in everything.excluded[ENDPOINT_PLUGINS]] == ["hello"]
    assert "fake_endpoint" not in sys.modules and list(everything.by_name(ATTENTION_BACKENDS)) == ["FAKE_A"]
    named = load(site, "hello,FAKE_A")
    assert named.by_name(ENDPOINT_PLUGINS)["hello"].target.name == "hello"
