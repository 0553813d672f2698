"""Answers for the provider functions (invokes) the stack program calls, for the mock engine.

Any invoke without an entry here fails the plan loudly, so a new data-source call cannot slip
through with a made-up answer. Values mirror the shape of the real responses. Each cloud's
answers live with the cloud (infra/clouds/<cloud>/mocks.py, named by its profile's
`mocks_module`) and are gathered here through the registry; the providers every cloud shares
(random, docker-build) are answered below.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Callable
from typing import Any

from infra.clouds import profiles
from infra.plan.engine import InvokeHandler

INVOKES: dict[str, InvokeHandler] = {}
# Outputs the real provider computes that the program reads back (mock resources otherwise
# echo their inputs). Keyed by type token.
COMPUTED: dict[str, Callable[[str, dict[str, Any]], dict[str, Any]]] = {}


# --- generated secrets ---------------------------------------------------------------------------

def _random_password(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """A value of the requested length, stable per name (the real provider draws it once)."""
    length = int(inputs.get("length") or 32)
    return {"result": (hashlib.sha256(name.encode()).hexdigest() * 4)[:length]}


# --- the trainer image ---------------------------------------------------------------------------

def _docker_image(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """The digest a push would report: derived from the tags and build inputs, stable per run."""
    digest = "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    tags = inputs.get("tags") or [name]
    return {"digest": digest, "ref": f"{str(tags[0]).rsplit(':', 1)[0]}@{digest}"}


for _cloud in profiles():
    _mocks = importlib.import_module(_cloud.mocks_module)
    INVOKES.update(_mocks.INVOKES)
    COMPUTED.update(_mocks.COMPUTED)
COMPUTED.update({
    "random:index/randomPassword:RandomPassword": _random_password,
    "docker-build:index:Image": _docker_image,
})
