"""What a region's edge adds when `EdgeConfig.region` is set (issue 31, docs/regions.md): the
region's ready route for the global tier, the served-region response header, and the active
health check of the picker (router) cluster that makes the ready route mean something.

- `region_filters`: two HTTP filters put first in the chain: Envoy's `header_mutation`
  (every response, the edge's own replies included, carries `SERVED_REGION: <region>`) and
  Envoy's `health_check` in non-pass-through mode answering `GET REGION_READY_PATH` itself:
  200 while at least 1 % of the picker cluster's hosts are healthy (one of up to 100 routers),
  else 503 (an empty cluster is 503 too). The request never reaches a filter after it (no
  key is asked for, nothing is transcoded or picked).
- `picker_health_check`: the picker cluster's active gRPC health check
  (`grpc.health.v1.Health/Check`, service "", which every inferplane service answers
  SERVING while up and NOT_SERVING while it drains). Without it Envoy counts a listed host as
  healthy whatever its state, and the ready route would answer 200 with every router dead.
"""

from __future__ import annotations

from inferplane.edge._base import TYPE_URL_PREFIX, Resource, duration
from inferplane.regions import REGION_READY_PATH
from inferplane.wire.headers import SERVED_REGION

_HEADER_MUTATION = (
    TYPE_URL_PREFIX + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
)
_HEALTH_CHECK = TYPE_URL_PREFIX + "envoy.extensions.filters.http.health_check.v3.HealthCheck"

#: The filters `region_filters` puts first in the chain, in order.
REGION_FILTERS: tuple[str, ...] = (
    "envoy.filters.http.header_mutation",
    "envoy.filters.http.health_check",
)
#: The share (%) of the picker cluster's hosts that must be healthy for the region to be ready:
#: Envoy compares `100 × healthy < hosts × this` in whole numbers, so 1 means "any healthy host"
#: for up to 100 routers.
READY_MIN_HEALTHY_PERCENT = 1.0
#: The picker cluster's active health check: a check every second, 1 s timeout, a router
#: unhealthy after 2 failed checks and healthy again after 2 passed ones; the same interval
#: when the cluster carries no traffic (Envoy's default there is 60 s, which would keep a dead
#: router "healthy" for a minute on an idle region).
PICKER_CHECK_INTERVAL_S = 1.0
PICKER_CHECK_TIMEOUT_S = 1.0
PICKER_CHECK_THRESHOLD = 2


def region_filters(region: str, picker_cluster: str) -> list[Resource]:
    """The `REGION_FILTERS` http filters of the edge of `region` (a valid region name) whose
    picker cluster is `picker_cluster`: the served-region header on every response, and the
    ready route answered by Envoy (200 / 503, never forwarded)."""
    return [
        {
            "name": REGION_FILTERS[0],
            "typed_config": {
                "@type": _HEADER_MUTATION,
                "mutations": {
                    "response_mutations": [
                        {
                            "append": {
                                "header": {"key": SERVED_REGION, "value": region},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                            }
                        }
                    ]
                },
            },
        },
        {
            "name": REGION_FILTERS[1],
            "typed_config": {
                "@type": _HEALTH_CHECK,
                "pass_through_mode": False,
                "headers": [{"name": ":path", "string_match": {"exact": REGION_READY_PATH}}],
                "cluster_min_healthy_percentages": {
                    picker_cluster: {"value": READY_MIN_HEALTHY_PERCENT}
                },
            },
        },
    ]


def picker_health_check() -> Resource:
    """The picker cluster's `health_checks` entry: gRPC health (`grpc.health.v1`, service
    ""), `PICKER_CHECK_INTERVAL_S` with or without traffic, `PICKER_CHECK_TIMEOUT_S`,
    `PICKER_CHECK_THRESHOLD` failures to turn a router unhealthy and as many passes back."""
    interval = duration(PICKER_CHECK_INTERVAL_S)
    return {
        "timeout": duration(PICKER_CHECK_TIMEOUT_S),
        "interval": interval,
        "no_traffic_interval": interval,
        "unhealthy_threshold": PICKER_CHECK_THRESHOLD,
        "healthy_threshold": PICKER_CHECK_THRESHOLD,
        "grpc_health_check": {},
    }
