"""The test-only fault switch (`inferplane.replica.server.faults`): armed only by the test
environment variable and a model folder's marker, it fails an exact share of picker-routed
requests with INTERNAL engine_failed (HTTP 500, never retried by Envoy), and never a direct
caller's (warm-up, conformance)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from inferplane.api.inference.v1 import inference_pb2 as pb
from inferplane.api.inference.v1 import inference_pb2_grpc
from inferplane.fixtures import kimi_tiny as kt
from inferplane.replica.server import RequestOutcome
from inferplane.replica.server.faults import (
    FAULT_CODE,
    FAULT_MARKER,
    FAULTS_ENV,
    FaultSwitch,
    fault_switch,
)
from inferplane.replica.testing.pipeline import (
    FakeReplica,
    ScriptedEngine,
    kimi_tiny_ids,
    kimi_tiny_spec,
    run_scenario,
    script,
)
from inferplane.runtime import ConfigError, InternalError
from inferplane.wire import chat_request_from_dict
from inferplane.wire.headers import PICKER

OUTPUT = kt.NO_TOOL.output + "<|im_end|>"
LIVE = ((PICKER, "127.0.0.1:9"),)


def _faulty_model(tmp_path: Path, marker: object) -> Path:
    """A copy of the fixture model (its files linked) with the fault marker `marker`."""
    folder = tmp_path / "kimi-tiny-faulty"
    folder.mkdir()
    for item in kt.model_path().iterdir():
        (folder / item.name).symlink_to(item)
    text = marker if isinstance(marker, str) else json.dumps(marker)
    (folder / FAULT_MARKER).write_text(text)
    return folder


def _spec(model: Path):  # type: ignore[no-untyped-def]
    spec = kimi_tiny_spec()
    spec.model_source = str(model)
    return spec


def test_unarmed_without_the_environment_variable_even_with_a_marker(tmp_path: Path) -> None:
    spec = _spec(_faulty_model(tmp_path, {"error_rate": 1.0}))
    assert fault_switch(spec, environ={}) is None
    assert fault_switch(spec, environ={FAULTS_ENV: "0"}) is None
    assert fault_switch(kimi_tiny_spec(), environ={FAULTS_ENV: "1"}) is None  # no marker


def test_a_bad_marker_is_a_config_error_naming_the_file(tmp_path: Path) -> None:
    for i, marker in enumerate(["{", {"rate": 0.5}, {"error_rate": 0}, {"error_rate": 1.5}]):
        (tmp_path / str(i)).mkdir()
        spec = _spec(_faulty_model(tmp_path / str(i), marker))
        with pytest.raises(ConfigError, match=FAULT_MARKER):
            fault_switch(spec, environ={FAULTS_ENV: "1"})


@pytest.mark.parametrize(("rate", "failing"), [(0.5, [2, 4, 6, 8, 10]), (0.3, [4, 7, 10])])
def test_an_exact_share_of_live_requests_fails_evenly(rate: float, failing: list[int]) -> None:
    switch = FaultSwitch(rate, "test")
    failed = []
    for n in range(1, 11):
        switch.strike(live=False)  # a direct caller between each: never counted, never failed
        try:
            switch.strike(live=True)
        except InternalError as exc:
            assert exc.code == FAULT_CODE and exc.http_status == 500
            failed.append(n)
    assert failed == failing
    assert (switch.live_requests, switch.failed) == (10, len(failing))


def test_the_replica_fails_every_second_routed_request_as_an_engine_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Served over real gRPC: with error_rate 0.5 the 2nd and 4th picker-routed requests end
    INTERNAL with the engine's error code (the OpenAI trailers) and an error record; the direct
    request in between is served."""
    monkeypatch.setenv(FAULTS_ENV, "1")
    engine = ScriptedEngine(script(kimi_tiny_ids(OUTPUT)))
    replica = FakeReplica("r1", _spec(_faulty_model(tmp_path, {"error_rate": 0.5})), engine)
    outcomes: list[RequestOutcome] = []
    request = pb.CreateChatCompletionRequest(request=chat_request_from_dict(kt.NO_TOOL.request()))
    codes: list[object] = []

    async def body(stub: inference_pb2_grpc.InferenceServiceStub) -> None:
        for metadata in (LIVE, LIVE, (), LIVE, LIVE):
            try:
                await stub.CreateChatCompletion(request, metadata=metadata)
                codes.append("ok")
            except grpc.aio.AioRpcError as exc:
                trailers = dict(exc.trailing_metadata() or ())
                assert trailers["x-openai-error-code"] == FAULT_CODE
                codes.append(exc.code())

    run_scenario(engine, body, replicas=[replica], on_outcome=outcomes.append)
    internal = grpc.StatusCode.INTERNAL
    assert codes == ["ok", internal, "ok", "ok", internal]
    assert [o.error_code for o in outcomes] == ["", FAULT_CODE, "", "", FAULT_CODE]
