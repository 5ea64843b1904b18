"""Every serve flag's default is the default of the option field it sets (one owner)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import pytest

from streamer.cli import ENV_PREFIX, build_parser
from streamer.core.capacity import CapacityOptions
from streamer.core.diarization import DiarizationOptions
from streamer.core.protocol import StreamOptions
from streamer.core.segmenter import SegmenterOptions
from streamer.core.session import SessionOptions
from streamer.core.vad import DEFAULT_AGGRESSIVENESS
from streamer.model.options import RecognizerOptions
from streamer.model.serving.pool import DEFAULT_WORKERS_PER_DEVICE
from streamer.model.serving.worker import (
    DEFAULT_DECODE_TIMEOUT_S,
    DEFAULT_MODEL_PROCESS,
    WorkerOptions,
)
from streamer.server import server as server_module
from streamer.server.options import FileOptions
from streamer.server.server import ConnectionLimits, ServerOptions

# flags whose value is not a field of the same name, and what their default must be
RENAMED: dict[str, Any] = {
    "no_warmup": not RecognizerOptions().warmup,
    "quantize": RecognizerOptions().quantize or "none",
    "allowed_origins": ",".join(ServerOptions().allowed_origins),
    "endpoint_ms": ServerOptions().default_stream.endpoint_ms,  # a stream option's default
    "decode_timeout_s": DEFAULT_DECODE_TIMEOUT_S,  # ModelWorker's
    "workers": DEFAULT_WORKERS_PER_DEVICE,  # the pool's
    "max_batch": WorkerOptions().max_batch,  # the worker's (None: auto)
    "model_process": DEFAULT_MODEL_PROCESS,  # the worker's
    "max_batch_audio_s": WorkerOptions().max_batch_audio_s,  # the worker's (None: auto)
    "model_restarts": WorkerOptions().max_restarts,  # the worker's
    "capacity_admission": CapacityOptions().enabled,
    "max_file_jobs": FileOptions().max_jobs,
    "file_worker": False,  # the pool's (plan_slots(file_worker=...))
    "max_upload_mb": FileOptions().max_upload_bytes / (1 << 20),
    "max_file_duration_s": FileOptions().max_duration_s,
    "diarize_model": None,  # SessionOptions.diarization is None without speaker models
    "diarize_max_wait_ms": DiarizationOptions().max_wait_ms,
    "diarize_threshold": DiarizationOptions().match_threshold,
    "speakers": None,  # SessionOptions.known_speakers is () without --speakers
    "no_diarize_windows": not DiarizationOptions().change_windows,
}
# flags that set no option field
# (--hotwords is a file: SessionOptions.hotwords holds its phrases, () without it)
NOT_OPTIONS = {
    "help",
    "func",
    "vad",
    "log_level",
    "log_format",
    "no_uvloop",
    "cache_dir",
    "hotwords",
}
OWNERS = (
    ServerOptions,
    ConnectionLimits,
    SessionOptions,
    SegmenterOptions,
    RecognizerOptions,
    CapacityOptions,
    FileOptions,
)


def subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def field_defaults(cls: type) -> dict[str, Any]:
    instance = cls()
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(cls)}


@pytest.fixture(autouse=True)
def no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX):
            monkeypatch.delenv(name)


def test_each_serve_flag_default_is_its_option_field_default() -> None:
    checked = []
    for action in subparser("serve")._actions:
        name = action.dest
        if name in NOT_OPTIONS:
            continue
        if name in RENAMED:
            expected = RENAMED[name]
        else:
            owners = [fields[name] for fields in map(field_defaults, OWNERS) if name in fields]
            assert owners, f"--{name.replace('_', '-')}: no option field of that name"
            expected = owners[0]
        assert action.default == expected, name
        checked.append(name)
    assert len(checked) >= 25, checked  # not vacuous


def test_transcribe_defaults_are_the_options() -> None:
    defaults = {a.dest: a.default for a in subparser("transcribe")._actions}
    assert defaults["language"] == StreamOptions().language
    assert defaults["vad_aggressiveness"] == DEFAULT_AGGRESSIVENESS
    assert defaults["model"] == RecognizerOptions().model


def test_a_changed_field_default_moves_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Moved(ServerOptions):
        port: int = 9999

    monkeypatch.setattr(server_module, "ServerOptions", Moved)
    (port,) = [a for a in subparser("serve")._actions if a.dest == "port"]
    assert port.default == 9999


@pytest.mark.parametrize(
    "argv",
    [
        ["--endpoint-ms", "0"],  # started, then failed every session
        ["--port", "99999"],  # bound 99999 - 65536
        ["--idle-timeout-s", "nan"],
        ["--shutdown-grace-s", "inf"],
        ["--drain-s", "-1"],
        ["--max-message-bytes", "0"],
        ["--partial-interval-ms", "0"],
        ["--max-sessions", "0"],
        ["--wyoming-port", "-1"],
    ],
)
def test_serve_refuses_values_that_would_start_a_broken_server(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", *argv])
    assert exited.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("VAD_AGGRESSIVENESS", "7"),  # the flag's choices apply to its variable too
        ("LOG_LEVEL", "verbose"),  # was a traceback
        ("LOG_FORMAT", "xml"),  # was silently text
        ("ENDPOINT_MS", "0"),
        ("PORT", "abc"),
    ],
)
def test_a_bad_environment_value_is_refused_like_a_bad_flag(
    variable, value, monkeypatch, capsys
) -> None:
    monkeypatch.setenv(ENV_PREFIX + variable, value)
    with pytest.raises(SystemExit) as exited:
        build_parser()
    assert exited.value.code == 2
    assert f"{ENV_PREFIX}{variable}={value!r} is not valid" in capsys.readouterr().err


def test_no_uvloop_has_its_environment_variable_too(monkeypatch) -> None:
    monkeypatch.setenv(ENV_PREFIX + "NO_UVLOOP", "1")
    assert subparser("serve").parse_args([]).no_uvloop is True


def test_a_cache_dir_that_cannot_be_made_is_a_config_error(tmp_path) -> None:
    """Said at start, with the path; it was a traceback from deep in the model's loading."""
    from streamer.cli.common import _recognizer_options
    from streamer.errors import ConfigError

    (tmp_path / "a-file").write_text("")
    args = subparser("serve").parse_args(["--cache-dir", str(tmp_path / "a-file" / "cache")])
    with pytest.raises(ConfigError, match="--cache-dir .*a-file/cache cannot be used"):
        _recognizer_options(args)
    args = subparser("serve").parse_args(["--cache-dir", str(tmp_path / "new" / "cache")])
    assert _recognizer_options(args).cache_dir == tmp_path / "new" / "cache"
    assert (tmp_path / "new" / "cache").is_dir()


def test_serve_help_names_every_variable() -> None:
    """Every serve flag has its STREAMER_* variable, and --help lists each one."""
    parser = subparser("serve")
    text = " ".join(parser.format_help().split())
    flags = [
        action.option_strings[0]
        for action in parser._actions
        if action.option_strings and action.option_strings[0].startswith("--")
        and action.dest != "help"
    ]  # fmt: skip
    assert len(flags) >= 45, flags
    missing = [f for f in flags if f"STREAMER_{f[2:].upper().replace('-', '_')}" not in text]
    assert missing == []
