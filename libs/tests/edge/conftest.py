"""Fixtures for the edge tests: one real Envoy per test module in front of the fakes."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envoy.service.auth.v3 import external_auth_pb2_grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from inferplane.api.auth.v1 import auth_pb2_grpc
from inferplane.api.inference.v1 import inference_pb2_grpc as pb_grpc
from inferplane.edge import EdgeConfig, Endpoint, EnvoyProcess
from inferplane.testing.picker import FakePicker

from ._fakes import FakeAuthz, FakeInference, free_port, start_grpc_server


@dataclasses.dataclass
class Edge:
    """A running edge: Envoy plus its fakes. `inference` is both the replica the picker picks
    and the router's `ListModels`; `picker` is the endpoint picker (ext_proc)."""

    envoy: EnvoyProcess
    config: EdgeConfig
    inference: FakeInference
    authz: FakeAuthz
    picker: FakePicker
    backend_port: int

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls else "http"
        return f"{scheme}://127.0.0.1:{self.config.listen_port}"


@contextlib.contextmanager
def running_edge(data_dir: Path, **overrides: Any) -> Iterator[Edge]:
    """Envoy in front of fresh fakes; `overrides` are `EdgeConfig` fields (e.g. TLS)."""
    inference, authz, picker = FakeInference(), FakeAuthz(), FakePicker()
    backend, backend_port = start_grpc_server(
        (pb_grpc.add_InferenceServiceServicer_to_server, inference),
        (ep_grpc.add_ExternalProcessorServicer_to_server, picker),
    )
    picker.targets = [f"127.0.0.1:{backend_port}"]
    auth_server, auth_port = start_grpc_server(
        (external_auth_pb2_grpc.add_AuthorizationServicer_to_server, authz),
        (auth_pb2_grpc.add_ApiKeyServiceServicer_to_server, authz),
    )
    config = EdgeConfig(
        router_endpoints=(Endpoint("127.0.0.1", backend_port),),
        auth_endpoint=Endpoint("127.0.0.1", auth_port),
        replica_endpoints=(Endpoint("127.0.0.1", backend_port),),
        listen_port=free_port(),
        admin_port=free_port(),
        authz_timeout_s=0.5,
        **overrides,
    )
    envoy = EnvoyProcess.from_config(config, data_dir, concurrency=2)
    try:
        envoy.start()
        yield Edge(envoy, config, inference, authz, picker, backend_port)
    finally:
        envoy.stop()
        backend.stop(grace=None)
        auth_server.stop(grace=None)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    with running_edge(Path(tmp_path_factory.mktemp("edge"))) as running:
        yield running
