"""``relaylm serve``'s models: one worker per ``--model`` (or per RELAYLM_MODEL entry), the chat
and the embedding default when none is named, and the settings several workers cannot share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias

import click
import pytest
from click.testing import CliRunner, Result

import relaylm.supervisor
from api.settings import ApiSettings
from relaylm.cli import main
from relaylm.serve_models import DEFAULT_EMBEDDING_MODEL, DEFAULT_SERVE_MODELS
from relaylm.supervisor import Supervisor
from worker.embedding.loader import DEFAULT_EMBEDDING_MODEL as WORKER_DEFAULT_EMBEDDING_MODEL
from worker.settings import DEFAULT_MODEL, WorkerSettings

Serve: TypeAlias = Callable[..., Result]


class _RecordingSupervisor:
    """Stands in for the supervisor: records what serve would run, starts nothing."""

    runs: ClassVar[list[dict[str, Any]]] = []

    def __init__(
        self, api_settings: ApiSettings, worker_settings: WorkerSettings, models: list[str], given: dict[str, Any]
    ) -> None:
        self.run_args = {"worker_settings": worker_settings, "models": models, "given": given}

    def run(self) -> int:
        self.runs.append(self.run_args)
        return 0


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Serve:
    """Invoke ``relaylm serve ARGS`` with a clean RELAYLM_* environment plus ``env``."""
    monkeypatch.setattr(relaylm.supervisor, "Supervisor", _RecordingSupervisor)
    _RecordingSupervisor.runs = []

    def invoke(*args: str, env: dict[str, str] | None = None) -> Result:
        for name in ("RELAYLM_MODEL", "RELAYLM_SERVED_MODEL_NAME", "RELAYLM_WORKER_ID", "RELAYLM_TASK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        return CliRunner().invoke(main, ["serve", *args])

    return invoke


def _served_models(result: Result) -> list[str]:
    assert result.exit_code == 0, result.output
    (run,) = _RecordingSupervisor.runs
    models: list[str] = run["models"]
    return models


def test_no_model_serves_the_default_chat_and_embedding_models(serve: Serve) -> None:
    assert _served_models(serve()) == [DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL]
    assert DEFAULT_SERVE_MODELS == (DEFAULT_MODEL, DEFAULT_EMBEDDING_MODEL)


def test_the_embedding_default_is_the_one_the_worker_loads() -> None:
    assert DEFAULT_EMBEDDING_MODEL == WORKER_DEFAULT_EMBEDDING_MODEL


def test_each_model_flag_is_one_worker_and_the_other_flags_are_shared(serve: Serve) -> None:
    result = serve("--model", "a", "--model", "whisper-tiny.en", "--port", "9001")
    assert _served_models(result) == ["a", "whisper-tiny.en"]
    given = _RecordingSupervisor.runs[0]["given"]
    assert given["port"] == 9001 and "model" not in given


def test_relaylm_model_takes_a_comma_separated_list_and_flags_win(serve: Serve) -> None:
    assert _served_models(serve(env={"RELAYLM_MODEL": "a, b"})) == ["a", "b"]
    _RecordingSupervisor.runs = []
    assert _served_models(serve("--model", "c", env={"RELAYLM_MODEL": "a,b"})) == ["c"]


def test_one_model_keeps_its_served_name(serve: Serve) -> None:
    assert _served_models(serve("--model", "/models/x", "--served-model-name", "x")) == ["/models/x"]
    assert _RecordingSupervisor.runs[0]["worker_settings"].model_id == "x"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (("--served-model-name", "x"), {}, "--served-model-name (or RELAYLM_SERVED_MODEL_NAME) names one model"),
        (("--model", "a", "--model", "b"), {"RELAYLM_SERVED_MODEL_NAME": "x"}, "names one model, but serve runs 2"),
        (("--model", "a", "--model", "b", "--worker-id", "w"), {}, "--worker-id (or RELAYLM_WORKER_ID) names one"),
        (("--model", "a", "--model", "b", "--task", "embed"), {}, "--task embed (or RELAYLM_TASK) would apply"),
        (("--model", "a", "--model", "b", "--model", "a"), {}, "model 'a' is named twice"),
        ((), {"RELAYLM_MODEL": " , "}, "names no model"),
    ],
)
def test_what_several_workers_cannot_share_is_a_usage_error(
    serve: Serve, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    result = serve(*args, env=env)
    assert result.exit_code == 2
    assert message in result.output
    assert _RecordingSupervisor.runs == []


def test_serve_takes_model_several_times_and_worker_once() -> None:
    def model_option(command: str) -> click.Parameter:
        return next(param for param in main.commands[command].params if param.name == "model")

    assert model_option("serve").multiple
    assert not model_option("worker").multiple


def test_serve_help_says_how_to_name_several_models() -> None:
    help_text = " ".join(CliRunner().invoke(main, ["serve", "--help"], terminal_width=200).output.split())
    assert "Repeat it for several models" in help_text
    assert "[env: RELAYLM_MODEL, comma-separated; default: smollm2-135m-instruct and all-minilm-l6-v2]" in help_text
    worker_help = " ".join(CliRunner().invoke(main, ["worker", "--help"], terminal_width=200).output.split())
    assert "[env: RELAYLM_MODEL; default: smollm2-135m-instruct]" in worker_help


def test_the_supervisor_runs_one_named_worker_per_model_and_the_api() -> None:
    supervisor = Supervisor(ApiSettings(), WorkerSettings(), ["a", "all-minilm-l6-v2"], {})
    assert [child.name for child in supervisor.children] == ["worker for a", "worker for all-minilm-l6-v2", "api"]
    assert [child.model for child in supervisor.workers] == ["a", "all-minilm-l6-v2"]
    renamed = Supervisor(ApiSettings(), WorkerSettings(served_model_name="tiny"), ["/models/tiny"], {})
    assert [child.name for child in renamed.workers] == ["worker for tiny"]
