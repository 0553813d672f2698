"""A local stand-in for each cloud's instance metadata service: the token handshake (AWS IMDSv2,
Alibaba hardened mode), the role listing and the role's temporary credentials in the cloud's
documented format, and the spot notice. Credentials rotate on demand and can expire, and the
server can be told to answer 404 or garbage, so callers' error paths are exercised too."""

from __future__ import annotations

import json
import threading
import urllib.parse
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROLE = "gts-node-role"
SPOT_PATHS = {"aws": "/latest/meta-data/spot/instance-action",
              "alicloud": "/latest/meta-data/instance/spot/termination-time",
              "tencentcloud": "/latest/meta-data/spot/termination-time"}
CREDENTIAL_PATHS = {"aws": "/latest/meta-data/iam/security-credentials/",
                    "alicloud": "/latest/meta-data/ram/security-credentials/",
                    "tencentcloud": "/latest/meta-data/cam/security-credentials/"}
POD_IDENTITY_PATH = "/v1/credentials"  # the EKS Pod Identity agent's (AWS_CONTAINER_CREDENTIALS_FULL_URI)
TOKEN_HEADERS = {"aws": ("X-aws-ec2-metadata-token-ttl-seconds", "X-aws-ec2-metadata-token"),
                 "alicloud": ("X-aliyun-ecs-metadata-token-ttl-seconds", "X-aliyun-ecs-metadata-token")}


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class _Handler(BaseHTTPRequestHandler):
    """One request to a FakeMetadata (`owner`, set per server by FakeMetadata.__init__)."""

    owner: FakeMetadata

    def log_message(self, *args: Any) -> None:
        pass

    def do_PUT(self) -> None:  # noqa: N802 (http.server's method name)
        headers = TOKEN_HEADERS.get(self.owner.cloud)
        if self.path != "/latest/api/token" or headers is None or not self.headers.get(headers[0]):
            self.send_error(400)
            return
        self._reply(200, self.owner.token)

    def do_POST(self) -> None:  # noqa: N802
        if self.headers.get("X-TC-Action"):
            self._tencent_sts()
            return
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
        if query.get("Action") != "AssumeRoleWithOIDC" or not query.get("OIDCToken"):
            self.send_error(400)
            return
        self.owner.oidc_tokens.append(query["OIDCToken"])
        doc = json.loads(self.owner.document())  # alicloud's credential fields
        self._reply(200, json.dumps({"RequestId": "r-1", "Credentials": doc}))

    def do_GET(self) -> None:  # noqa: N802
        self.owner.requests += 1
        if self.path == POD_IDENTITY_PATH:
            if self.headers.get("Authorization") != self.owner.pod_identity_token:
                self.send_error(401)
                return
            self.owner.credential_requests += 1
            self._reply(200, self.owner.document())
            return
        headers = TOKEN_HEADERS.get(self.owner.cloud)
        if headers and self.headers.get(headers[1]) != self.owner.token:
            self.send_error(401)
            return
        base = CREDENTIAL_PATHS[self.owner.cloud]
        if self.path == base:
            self._reply(200, ROLE)
        elif self.path == base + ROLE:
            self.owner.credential_requests += 1
            if self.owner.mode == "404":
                self.send_error(404)
            else:
                self._reply(200, "<html>oops</html>" if self.owner.mode == "garbage" else self.owner.document())
        elif self.path == SPOT_PATHS[self.owner.cloud] and self.owner.spot_notice:
            self._reply(200, self.owner.spot_notice)
        elif self.path in self.owner.extra:
            self._reply(200, self.owner.extra[self.path])
        else:
            self.send_error(404)

    def _tencent_sts(self) -> None:
        """Tencent STS's AssumeRoleWithWebIdentity: JSON in, {"Response": ...} out."""
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        self.owner.web_identity_requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
        if self.headers.get("X-TC-Action") != "AssumeRoleWithWebIdentity" or self.path != "/":
            self.send_error(400)
            return
        if body.get("WebIdentityToken") != self.owner.web_identity_token:
            self._reply(200, json.dumps({"Response": {"Error": {
                "Code": "InvalidParameter.WebIdentityTokenError", "Message": "token invalid"},
                "RequestId": "r-2"}}))
            return
        self.owner.credential_requests += 1
        doc = json.loads(self.owner.document())  # tencentcloud's credential fields
        self._reply(200, json.dumps({"Response": {
            "Credentials": {k: doc[k] for k in ("Token", "TmpSecretId", "TmpSecretKey")},
            "ExpiredTime": doc["ExpiredTime"], "Expiration": doc["Expiration"], "RequestId": "r-1"}}))

    def _reply(self, code: int, body: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class FakeMetadata:
    """Serves one cloud's metadata on 127.0.0.1 (start() / stop(), or as a context manager); the
    boot test binds it to 169.254.169.254:80 inside the booted node's network namespace."""

    def __init__(self, cloud: str, lifetime: float = 3600.0, host: str = "127.0.0.1", port: int = 0):
        self.cloud = cloud
        self.lifetime = lifetime
        self.generation = 0  # bumped by rotate(): the access key carries it
        self.mode = "ok"  # ok | 404 | garbage
        self.spot_notice: str | None = None
        self.extra: dict[str, str] = {}  # other paths, e.g. AWS's rebalance recommendation
        self.credential_requests = 0
        self.requests = 0  # every GET answered: a test waits on it instead of sleeping
        self.token = "tok-123"
        # Alibaba STS AssumeRoleWithOIDC (ACK RRSA) and the EKS Pod Identity agent, on the same port
        self.oidc_tokens: list[str] = []
        self.pod_identity_token = "pod-identity-token"
        # Tencent STS AssumeRoleWithWebIdentity (TKE pod identity): each request's headers (lower-case
        # names) and JSON body; the token to accept (anything else is refused as Tencent refuses, HTTP 200 + Error)
        self.web_identity_requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.web_identity_token = "tke-projected-token"
        handler = type("Handler", (_Handler,), {"owner": self})
        self.server = ThreadingHTTPServer((host, port), handler)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}" if isinstance(host, str) else f"http://{host.decode()}:{port}"

    def access_key(self) -> str:
        return f"STS.{self.cloud}.{self.generation}"

    def rotate(self) -> None:
        self.generation += 1

    def document(self) -> str:
        """The role credentials as the cloud documents them."""
        expires = time.time() + self.lifetime
        key, secret, token = self.access_key(), f"secret-{self.generation}", f"token-{self.generation}"
        if self.cloud == "aws":
            doc: dict[str, Any] = {"Code": "Success", "LastUpdated": _stamp(time.time()), "Type": "AWS-HMAC",
                                   "AccessKeyId": key, "SecretAccessKey": secret, "Token": token,
                                   "Expiration": _stamp(expires)}
        elif self.cloud == "alicloud":
            doc = {"AccessKeyId": key, "AccessKeySecret": secret, "Expiration": _stamp(expires),
                   "SecurityToken": token, "LastUpdated": _stamp(time.time()), "Code": "Success"}
        else:
            doc = {"TmpSecretId": key, "TmpSecretKey": secret, "ExpiredTime": int(expires),
                   "Expiration": _stamp(expires), "Token": token, "Code": "Success"}
        return json.dumps(doc)

    def start(self) -> FakeMetadata:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeMetadata:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
