"""An operator's request pinned to one profile revision (issue 30, the performance gate).

The request header `inferplane-revision` (`inferplane.wire.headers.REVISION`) names a profile
revision of the request's model. The picker:

- honours it only for a key with the `admin` scope (auth's verdict, `x-inferplane-scopes`);
  any other key gets 403 `insufficient_scope` in the API's error shape, before admission;
- restricts the pick to that revision's endpoints, whatever the route's canary shares say:
  a candidate under qualification, which has no share and takes no live traffic, is reached
  this way; the fallbacks Envoy may retry on are that revision's too (`CanaryChoice.dark`
  holds every other endpoint, so `canary.order_fallbacks` drops them);
- answers 503 `revision_unavailable` when the route has no non-draining endpoint of it;
- removes the header from the request before the replica (`strip`);
- names the served endpoint's revision in the response (`x-inferplane-revision-served`,
  `headers.SERVED_REVISION`: `mark_served`), pinned or not, when the routing table knows it.

An empty header is no pin. Cost when absent: one dictionary lookup per request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb

from inferplane.router.canary import CanaryChoice
from inferplane.router.routes import Endpoint, ModelRoute
from inferplane.runtime import PermissionDeniedError, UnavailableError
from inferplane.runtime.security.api_keys import SCOPE_ADMIN
from inferplane.wire import headers

#: The error code of a pin to a revision with no usable endpoint (503).
REVISION_UNAVAILABLE = "revision_unavailable"


def requested(metadata: Mapping[str, str]) -> str:
    """The revision the request pins ("" when it pins none)."""
    return metadata.get(headers.REVISION, "").strip()


def pin(route: ModelRoute, revision: str, metadata: Mapping[str, str]) -> CanaryChoice:
    """The pinned request's choice: `revision`, every other endpoint excluded and dark.

    Raises:
        PermissionDeniedError: the key lacks the `admin` scope (403 insufficient_scope).
        UnavailableError: no non-draining endpoint of `route` runs `revision` (503
            revision_unavailable).
    """
    scopes = {s.strip() for s in metadata.get(headers.SCOPES, "").split(",")}
    if SCOPE_ADMIN not in scopes:
        raise PermissionDeniedError(
            f"The {headers.REVISION} header needs an API key with the '{SCOPE_ADMIN}' scope.",
            code="insufficient_scope",
            param=headers.REVISION,
        )
    own = [e for e in route.endpoints if e.revision == revision and not e.draining]
    if not own:
        raise UnavailableError(
            f"no ready replica of '{route.model}' runs revision '{revision}'",
            code=REVISION_UNAVAILABLE,
        )
    others = frozenset(e.key for e in route.endpoints if e.revision != revision)
    return CanaryChoice(revision=revision, exclude=others, dark=others, wanted=revision)


def strip(mutation: ext_pb.HeaderMutation, metadata: Mapping[str, str]) -> None:
    """Removes the pin header (when the request has one) with the request-headers answer."""
    if headers.REVISION in metadata:
        mutation.remove_headers.append(headers.REVISION)


def served(endpoints: Sequence[Endpoint], response_headers: Mapping[str, str]) -> Endpoint | None:
    """The endpoint among the picked `endpoints` whose replica answered (the replica names
    itself in `x-inferplane-replica`, `headers.SERVED_BY`); None when no replica did."""
    replica_id = response_headers.get(headers.SERVED_BY, "")
    if not replica_id:
        return None
    return next((e for e in endpoints if e.replica_id == replica_id), None)


def mark_served(mutation: ext_pb.HeaderMutation, served: Endpoint | None) -> None:
    """Adds `x-inferplane-revision-served` with `served`'s revision to the response headers
    (nothing when it is unknown)."""
    if served is not None and served.revision:
        mutation.set_headers.add(
            header=base_pb2.HeaderValue(
                key=headers.SERVED_REVISION, raw_value=served.revision.encode()
            ),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
