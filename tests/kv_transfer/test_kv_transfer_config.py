"""``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)``: vLLM's JSON as written, errors
naming the field, the connector found by name, alias or module path, and what the engine
refuses (several ranks, several KV-cache groups, kv_transfer_params without a connector)."""

from __future__ import annotations

import json

import pytest

from kvloom.engine.arg_utils import EngineArgs
from kvloom.entrypoints.cli.engine_args import add_engine_args, engine_args_from_namespace
from kvloom.interfaces import KVCacheGroupSpec, KVConnectorRole, KVTransferConfig
from kvloom.kv_transfer.config import offloading_transfer_config, parse_kv_transfer_config
from kvloom.kv_transfer.factory import check_kv_transfer_params, connector_class, make_connector
from kvloom.testing.kv_connector import kv_connector_config
from tests.kv_transfer.memory_connector import MemoryConnector, transfer_config

VLLM_JSON = {
    "kv_connector": "P2pNcclConnector", "kv_role": "kv_consumer", "kv_rank": 1, "kv_parallel_size": 2,
    "kv_buffer_size": 1e9, "kv_ip": "10.0.0.1", "kv_port": 21001, "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {"send_timeout_s": 30},
}  # fmt: skip


def test_vllm_json_is_taken_as_written() -> None:
    config = parse_kv_transfer_config(json.dumps(VLLM_JSON))
    assert config is not None and config.kv_rank == 1 and config.kv_port == 21001
    assert config.is_kv_consumer and not config.is_kv_producer
    assert config.get_from_extra_config("send_timeout_s", None) == 30
    assert KVTransferConfig(kv_connector="X", kv_role="kv_both").kv_load_failure_policy == "fail"


@pytest.mark.parametrize(("value", "field"), [
    ({"kv_connector": "X", "kv_role": "kv_reader"}, "kv_transfer_config.kv_role"),
    ({"kv_connector": "X"}, "kv_transfer_config.kv_role: required"),
    ({"kv_connector": "X", "kv_role": "kv_both", "kv_load_failure_policy": "retry"},
     "kv_transfer_config.kv_load_failure_policy"),
    ({"kv_connector": "X", "kv_role": "kv_both", "kv_port": 0}, "kv_transfer_config.kv_port"),
    ({"kv_connector": "X", "kv_role": "kv_both", "kv_connecter_extra_config": {}},
     "kv_transfer_config.kv_connecter_extra_config: unknown field"),
    ("{not json", "kv_transfer_config: not a JSON object"),
    ([1, 2], "kv_transfer_config: must be a JSON object"),
])  # fmt: skip
def test_a_bad_value_names_the_field(value: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(kv_transfer_config=value)


def test_the_cli_flag_takes_the_json() -> None:
    import argparse

    parser = add_engine_args(argparse.ArgumentParser())
    namespace = parser.parse_args(["--kv-transfer-config", json.dumps(VLLM_JSON), "--kv-offloading-size", "2"])
    args = engine_args_from_namespace(namespace)
    assert args.kv_transfer_config is not None and args.kv_transfer_config["kv_rank"] == 1
    with pytest.raises(ValueError, match="--kv-transfer-config: .*kv_role"):
        engine_args_from_namespace(parser.parse_args(["--kv-transfer-config", '{"kv_connector": "X"}']))


def test_kv_offloading_size_selects_the_offloading_connector() -> None:
    config = offloading_transfer_config(None, 1.5, "native")
    assert config is not None and config.kv_connector == "OffloadingConnector" and config.kv_role == "kv_both"
    assert config.kv_connector_extra_config == {"cpu_bytes_to_use": int(1.5 * 2**30)}
    assert offloading_transfer_config(None, None, "native") is None
    with pytest.raises(ValueError, match="kv_offloading_backend: 'lmcache' is not supported by kvloom yet"):
        offloading_transfer_config(None, 1.0, "lmcache")
    other = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")
    with pytest.raises(ValueError, match="kv_offloading_size: .*names 'ExampleConnector'"):
        offloading_transfer_config(other, 1.0, "native")


@pytest.mark.parametrize(("name", "message"), [
    ("OffloadingConnector", "needs the package kvloom-kv-offload"),
    ("NixlConnector", "'NixlConnector' is not supported by kvloom yet"),
    ("P2pNcclConnector", "needs the package kvloom-kv-p2p"),
    ("NoSuchConnector", "not a KV connector kvloom knows"),
])  # fmt: skip
def test_an_unknown_connector_says_what_to_do(name: str, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvloom.kv_transfer.factory._installed", lambda: {"MemoryConnector": MemoryConnector})
    with pytest.raises(ValueError, match=f"kv_transfer_config.kv_connector: .*{message}"):
        connector_class(KVTransferConfig(kv_connector=name, kv_role="kv_both"))


def test_old_names_and_module_paths_find_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MemoryConnector, "aliases", ("OldMemoryConnector",))
    monkeypatch.setattr("kvloom.kv_transfer.factory._installed", lambda: {"MemoryConnector": MemoryConnector})
    assert connector_class(KVTransferConfig(kv_connector="OldMemoryConnector", kv_role="kv_both")) is MemoryConnector
    assert connector_class(KVTransferConfig(**transfer_config())) is MemoryConnector
    with pytest.raises(ValueError, match="kv_connector_module_path: cannot import 'no.such.module'"):
        connector_class(KVTransferConfig(kv_connector="X", kv_role="kv_both", kv_connector_module_path="no.such.module"))
    with pytest.raises(ValueError, match="has no KV connector class 'STORE'"):
        connector_class(KVTransferConfig(**transfer_config("STORE")))


def test_the_engine_refuses_what_the_connector_cannot_run() -> None:
    with pytest.raises(ValueError, match=r"connector MemoryConnector cannot run this engine: kv_connector_extra_config: "
                                         r"unknown key\(s\) shared_storage_path \(allowed: load_async\)"):  # fmt: skip
        kv_connector_config(transfer_config(shared_storage_path="/tmp"))
    with pytest.raises(ValueError, match="one worker rank for now"):
        kv_connector_config(transfer_config(), tensor_parallel_size=2, distributed_executor_backend="mp")


def test_a_connector_of_one_group_refuses_a_hybrid_model() -> None:
    config = kv_connector_config(transfer_config())
    groups = (KVCacheGroupSpec(("a",), 16), KVCacheGroupSpec(("b",), 16))
    with pytest.raises(ValueError, match="MemoryConnector handles models of one KV-cache group; this model has 2"):
        make_connector(config, KVConnectorRole.SCHEDULER, groups)


def test_kv_transfer_params_need_a_connector() -> None:
    assert "runs no KV connector" in (check_kv_transfer_params(None, {"do_remote_decode": True}) or "")
    from kvloom import SamplingParams

    with pytest.raises(ValueError, match="kv_transfer_params.do_remote_decode must be true or false"):
        SamplingParams(kv_transfer_params={"do_remote_decode": "yes"})
    with pytest.raises(ValueError, match="at most 16384"):
        SamplingParams(kv_transfer_params={"x": "y" * 20000})
