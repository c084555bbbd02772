"""Plugin API 1.0's worker face keeps working in 1.1, with deprecation warnings: a worker
whose ``__init__`` takes no ``model_runner_cls``, whose ``execute_model`` returns a finished
``ModelRunnerOutput``, that calls the old ``*_async`` verbs, or a plugin that imports the
runner class from ``kvloom.interfaces``."""

from __future__ import annotations

import warnings

import pytest
from tests.helpers.model_fixtures import tiny_model_dir

from kvloom import deprecation
from kvloom.executor.abstract import as_pending, make_worker
from kvloom.outputs import ModelRunnerOutput, PendingModelRunnerOutput
from kvloom.platforms.worker import Worker
from kvloom.testing import resolve_engine_config
from kvloom.worker.model_runner import ModelRunner


@pytest.fixture(autouse=True)
def _warn_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees the once-per-process warnings afresh."""
    deprecation.reset_warnings_for_tests()


class OldInitWorker(Worker):
    """A 1.0 worker that overrides ``__init__`` with the old signature."""

    def __init__(self, config, platform):  # type: ignore[no-untyped-def]
        super().__init__(config, platform)


def test_a_worker_without_model_runner_cls_in_its_init_is_handed_the_runner_with_a_warning(monkeypatch):
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32")
    monkeypatch.setattr(config.device.platform, "get_worker_cls", classmethod(lambda cls: OldInitWorker))
    with pytest.warns(DeprecationWarning, match="without model_runner_cls"):
        worker = make_worker(config)
    assert isinstance(worker, OldInitWorker) and worker.model_runner_cls is ModelRunner


def test_a_new_worker_is_handed_the_runner_silently():
    config = resolve_engine_config(model=str(tiny_model_dir("llama")), dtype="float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        worker = make_worker(config)
    assert worker.model_runner_cls is ModelRunner


def test_a_finished_output_from_a_10_worker_is_accepted_with_a_warning():
    output = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]])
    with pytest.warns(DeprecationWarning, match="returning ModelRunnerOutput"):
        pending = as_pending(output)
    assert isinstance(pending, PendingModelRunnerOutput) and pending.get_output() is output
    launched = PendingModelRunnerOutput.done(output)
    assert as_pending(launched) is launched and as_pending(None) is None


def test_the_old_async_verbs_are_aliases_of_the_two_verbs():
    class Recording(Worker):
        def __init__(self) -> None:  # no device needed
            self.calls: list[str] = []

        def execute_model(self, scheduler_output):  # type: ignore[no-untyped-def]
            self.calls.append("execute_model")

        def sample_tokens(self, grammar_output):  # type: ignore[no-untyped-def]
            self.calls.append("sample_tokens")

    worker = Recording()
    with pytest.warns(DeprecationWarning, match="execute_model_async"):
        worker.execute_model_async(None)  # type: ignore[arg-type]
    with pytest.warns(DeprecationWarning, match="sample_tokens_async"):
        worker.sample_tokens_async(None)
    assert worker.calls == ["execute_model", "sample_tokens"]


def test_interfaces_model_runner_is_a_deprecated_alias_of_the_class():
    import kvloom.interfaces as face

    assert "ModelRunner" not in face.__all__ and "ModelRunnerProtocol" in face.__all__
    with pytest.warns(DeprecationWarning, match="kvloom.interfaces.ModelRunner"):
        runner_cls = face.ModelRunner
    assert runner_cls is ModelRunner
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        face.NoSuchName  # noqa: B018
