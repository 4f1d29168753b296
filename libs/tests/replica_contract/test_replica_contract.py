"""The supervisor ⇄ replica contract (`inferplane.replica_contract`): the flags round-trip
through the command line, each default is written once, tasks and transports keep their
strings."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from inferplane.api.nodeagent.v1 import nodeagent_pb2
from inferplane.replica_contract import (
    DEFAULT_FLAGS,
    EMBED_TRANSPORTS,
    SPEECH_TRANSPORTS,
    TASKS,
    TRANSPORTS,
    ReplicaFlags,
    Task,
    Transport,
    pooling_args,
    replica_task,
    resolve_transport,
    with_enum_fields,
)
from inferplane.runtime.security.identity import PeerSecurity

ROOT = Path(__file__).resolve().parents[3]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    ReplicaFlags.add_to(p)
    return p


def round_trip(flags: ReplicaFlags) -> ReplicaFlags:
    return ReplicaFlags.from_args(parser().parse_args(flags.to_argv()))


def off_default(field: dataclasses.Field[object]) -> object:
    """A value of the field's type that is not its default."""
    default = field.default
    if isinstance(default, bool):
        return not default
    if isinstance(default, Transport):
        return Transport.GRPC
    if field.name == "device":
        return "gpu"
    if isinstance(default, float):
        return default + 2.5
    if isinstance(default, int):
        return default + 4321
    if isinstance(default, str):
        return default + "x"
    return Path("/srv/replicas/r1") / field.name  # Path | None fields


def test_every_field_round_trips_through_the_command_line() -> None:
    """Each field set off its default comes back equal, one field at a time and all at once;
    the defaults come back too (a written flag equal to its default, an unwritten one)."""
    base = ReplicaFlags(replica_id="r1", spec_file=Path("/d/replicas/r1/spec.json"))
    everything = {}
    for field in dataclasses.fields(ReplicaFlags):
        if field.name in ("replica_id", "spec_file"):
            continue
        value = off_default(field)
        everything[field.name] = value
        one = dataclasses.replace(base, **{field.name: value})
        assert round_trip(one) == one, field.name
    assert round_trip(base) == base
    all_set = dataclasses.replace(base, **everything)
    assert round_trip(all_set) == all_set
    assert isinstance(round_trip(all_set).transport, Transport)


def test_each_default_is_written_once() -> None:
    """The parser's defaults are the fields' (the replica process and the fake declare the
    flags with `add_to` only), and no replica module or the fake declares a contract flag
    itself."""
    parsed = parser().parse_args(["--replica-id", "r", "--spec-file", "/s", "--plaintext"])
    got = ReplicaFlags.from_args(parsed)
    assert got == dataclasses.replace(DEFAULT_FLAGS, replica_id="r", spec_file=Path("/s"))
    options = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ReplicaFlags)}
    options |= {"--plaintext", "--no-gc-freeze"}
    declaring = re.compile(r"""add_argument\(\s*["'](--[a-z-]+)""")
    files = [
        *(ROOT / "services/replica/inferplane/replica").glob("*.py"),
        ROOT / "libs/inferplane/testing/fake_replica.py",
    ]
    assert files[0].exists()
    for path in files:
        redeclared = set(declaring.findall(path.read_text())) & options
        assert not redeclared, f"{path} declares {sorted(redeclared)}: use ReplicaFlags.add_to"


def test_security_is_tls_or_an_explicit_plaintext_never_nothing() -> None:
    flags = ReplicaFlags(replica_id="r", spec_file=Path("/s"))
    assert "--plaintext" in flags.to_argv() and "--tls-dir" not in flags.to_argv()
    secure = flags.with_security(PeerSecurity(Path("/pki"), "node-agent"))
    argv = secure.to_argv()
    assert argv[argv.index("--tls-dir") + 1] == "/pki" and "--plaintext" not in argv
    assert round_trip(secure) == secure
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser().parse_args(["--replica-id", "r", "--spec-file", "/s"])
    with pytest.raises(ValueError, match="replica_id is required"):
        DEFAULT_FLAGS.to_argv()


def test_what_is_always_written_and_what_only_when_set() -> None:
    """The node-wide values the supervisor always states (so a replica never depends on its
    own reading of a default for them), the optional ones only when set."""
    argv = ReplicaFlags(replica_id="r", spec_file=Path("/s")).to_argv()
    for always in ("--host", "--port", "--transport", "--owned-by", "--identity"):
        assert always in argv, always
    assert argv[argv.index("--startup-timeout-seconds") + 1] == "180"
    assert argv[argv.index("--drain-grace-seconds") + 1] == "5"
    assert "--gc-freeze" in argv
    for unset in ("--telemetry-address", "--node-name", "--device", "--engine-address"):
        assert unset not in argv, unset


def test_tasks_and_transports_keep_their_strings() -> None:
    assert [str(t) for t in TASKS] == ["generate", "embed", "transcribe"]
    assert [str(t) for t in TRANSPORTS] == ["grpc", "http-completions", "inproc"]
    assert set(EMBED_TRANSPORTS) == {"inproc", "http-completions"}
    assert SPEECH_TRANSPORTS == ("inproc",)
    spec = nodeagent_pb2.ReplicaSpec(task="embed", transport="http-completions")
    assert replica_task(spec) == Task.EMBED == "embed"
    assert resolve_transport(spec) == "http-completions"
    assert replica_task(nodeagent_pb2.ReplicaSpec()) == "generate"
    assert resolve_transport(nodeagent_pb2.ReplicaSpec()) == "inproc"
    assert pooling_args(spec) == ["--runner", "pooling"]
    with pytest.raises(ValueError, match="cannot serve embeddings"):
        resolve_transport(nodeagent_pb2.ReplicaSpec(task="embed", transport="grpc"))


def test_the_enum_fields_win_over_the_deprecated_strings() -> None:
    na = nodeagent_pb2
    every_task = {t: getattr(na, f"REPLICA_TASK_{t.name}") for t in TASKS}
    every_transport = {t: getattr(na, f"REPLICA_TRANSPORT_{t.name}") for t in TRANSPORTS}
    for task, number in every_task.items():
        assert with_enum_fields(na.ReplicaSpec(task="generate", replica_task=number)).task == task
    for transport, number in every_transport.items():
        spec = na.ReplicaSpec(replica_transport=number)
        assert with_enum_fields(spec).transport == transport
    # No enum: the strings stand; the input is not modified.
    legacy = na.ReplicaSpec(task="embed", transport="grpc")
    assert with_enum_fields(legacy) == legacy
    enum_only = na.ReplicaSpec(replica_task=na.REPLICA_TASK_EMBED)
    assert with_enum_fields(enum_only).task == "embed" and enum_only.task == ""
    with pytest.raises(ValueError, match="ReplicaTask value 99"):
        with_enum_fields(na.ReplicaSpec(replica_task=99))
