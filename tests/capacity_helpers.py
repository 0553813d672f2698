"""What the capacity tests share: moto's AWS clients with the answers moto does not give
(recorded responses, tests/data/capacity/) injected at botocore's own before-call event, a count
of the API calls each client made, and a replaying transport for the Alibaba and Tencent calls
that records what was asked."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from moto import mock_aws

DATA = Path(__file__).parent / "data" / "capacity"


def recorded(cloud: str, name: str, **replace: str) -> dict[str, Any]:
    text = (DATA / cloud / f"{name}.json").read_text(encoding="utf-8")
    for old, new in replace.items():
        text = text.replace(old, new)
    return dict(json.loads(text))


class _Http:
    status_code = 200


class AwsCalls:
    """moto clients of one region; `answer(client, op, payload)` gives the answer moto lacks;
    `calls` counts every API call made through them (botocore's after-call event)."""

    def __init__(self, region: str):
        self.region = region
        self.ec2 = boto3.client("ec2", region_name=region)
        self.autoscaling = boto3.client("autoscaling", region_name=region)
        self.quotas = boto3.client("service-quotas", region_name=region)
        self.calls: list[str] = []
        for client in (self.ec2, self.autoscaling, self.quotas):
            client.meta.events.register("after-call", self._count)

    def _count(self, model: Any, **_: Any) -> None:
        self.calls.append(model.name)

    def answer(self, client: Any, operation: str, payload: dict[str, Any]) -> None:
        service = client.meta.service_model.service_id.hyphenize()
        client.meta.events.register(f"before-call.{service}.{operation}", lambda **_: (_Http(), payload))


@contextmanager
def moto_aws() -> Iterator[None]:
    with mock_aws():
        yield


class Replay:
    """A transport for the signed Alibaba / Tencent requests: answers by action, in order, and
    keeps each request (its action, parameters and headers) for the test to read."""

    def __init__(self, answers: dict[str, list[dict[str, Any]]]):
        self.answers = {k: list(v) for k, v in answers.items()}
        self.asked: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self.timeouts: list[float] = []  # each call's timeout, as the module gave it

    def __call__(self, request: urllib.request.Request, timeout: float) -> dict[str, Any]:
        self.timeouts.append(timeout)
        headers = dict(request.header_items())
        if request.data is not None:  # Tencent API 3.0: JSON body, action in a header
            action, params = headers.get("X-tc-action", ""), json.loads(bytes(request.data))  # type: ignore[arg-type]
        else:  # Alibaba RPC: everything in the query
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.full_url).query)
            params = {k: v[0] for k, v in query.items()}
            action = params["Action"]
        self.asked.append((action, params, headers))
        return self.answers[action].pop(0)
