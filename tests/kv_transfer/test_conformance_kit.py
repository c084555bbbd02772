"""The KV-connector conformance kit passes a connector that keeps the contract and catches
ones that break it (claims blocks it lacks, loads other data)."""

from __future__ import annotations

import pytest

from kvloom.testing.kv_connector import check_kv_connector
from tests.kv_transfer.memory_connector import STORE, transfer_config


@pytest.fixture(autouse=True)
def _empty_store() -> None:
    STORE.clear()


@pytest.mark.parametrize("load_async", [False, True])
def test_a_conforming_connector_passes(load_async: bool) -> None:
    assert check_kv_connector(transfer_config(load_async=load_async), across_engines=True) == []


def test_a_connector_that_claims_blocks_it_lacks_is_caught() -> None:
    problems = check_kv_connector(transfer_config("BrokenClaimsConnector"))
    assert problems and all("the lookup found" in p for p in problems), problems


def test_a_connector_that_loads_other_data_is_caught() -> None:
    problems = check_kv_connector(transfer_config("BrokenDataConnector"))
    assert any("differ from the saved ones" in p for p in problems), problems
