"""Teams that share a cloud cannot reach each other's runs (issue 27): a pod's own credentials.
A TKE pod exchanges its web-identity token at STS (never the node's metadata service); a
missing webhook variable, an unreadable token file or a plain-http STS endpoint is refused
by name before anything is sent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.training_helpers import ROOT


def _tke_env(meta: object, tmp: Path, token: str) -> dict[str, str]:
    from tests.metadata_server import FakeMetadata

    assert isinstance(meta, FakeMetadata)
    (tmp / "token").write_text(token)
    return {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT), "TKE_REGION": "ap-guangzhou",
            "TKE_PROVIDER_ID": "cls-abc", "TKE_ROLE_ARN": "qcs::cam::uin/100000000001:roleName/prod-tc-tke-train-pods",
            "TKE_WEB_IDENTITY_TOKEN_FILE": str(tmp / "token"), "GTS_STS_ENDPOINT": meta.url}


SHOW_CREDENTIALS = ("from training.credentials import credential_source; c = credential_source('tke-pod-identity', "
                    "__import__('os').environ)(); print(c.access_key, c.token, int(c.expires))")


def test_a_tke_pod_exchanges_its_token_at_sts_and_never_asks_the_metadata_service(tmp_path: Path) -> None:
    """A real process with what TKE's webhook gives a pod: the token file and the TKE_* variables.
    It asks STS the way the Tencent SDKs do (unsigned TC3 JSON POST), reads the token file anew
    each time (Kubernetes rotates it), and never reads the instance role."""
    from tests.metadata_server import FakeMetadata

    with FakeMetadata("tencentcloud") as meta:
        env = _tke_env(meta, tmp_path, meta.web_identity_token)
        got = subprocess.run([sys.executable, "-c", SHOW_CREDENTIALS], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=60)
        assert got.returncode == 0, got.stderr
        key, token, _ = got.stdout.split()
        assert (key, token) == ("STS.tencentcloud.0", "token-0")
        ((headers, body),) = meta.web_identity_requests
        assert headers["x-tc-action"] == "AssumeRoleWithWebIdentity" and headers["x-tc-version"] == "2018-08-13"
        assert headers["authorization"] == "SKIP" and headers["x-tc-region"] == "ap-guangzhou"
        assert headers["content-type"] == "application/json"
        assert body["ProviderId"] == "cls-abc" and body["WebIdentityToken"] == meta.web_identity_token
        assert body["RoleArn"] == env["TKE_ROLE_ARN"] and body["RoleSessionName"]
        assert meta.requests == 0, "no GET reached the metadata paths"
        # A rotated token is read again; a stolen or stale one is refused with STS's reason.
        meta.web_identity_token = "rotated"
        (tmp_path / "token").write_text("rotated")
        meta.rotate()
        again = subprocess.run([sys.executable, "-c", SHOW_CREDENTIALS], env=env, cwd=tmp_path, capture_output=True,
                               text=True, timeout=60)
        assert again.stdout.split()[0] == "STS.tencentcloud.1", again.stderr
        (tmp_path / "token").write_text("someone-elses-token")
        refused = subprocess.run([sys.executable, "-c", SHOW_CREDENTIALS], env=env, cwd=tmp_path, capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode != 0 and "InvalidParameter.WebIdentityTokenError" in refused.stderr


def test_a_pod_without_the_webhooks_variables_is_told_what_is_missing(tmp_path: Path) -> None:
    from training.cloudmeta import MetadataError
    from training.credentials import credential_source

    with pytest.raises(MetadataError, match="TKE_ROLE_ARN, TKE_WEB_IDENTITY_TOKEN_FILE .*tke.cloud.tencent.com/role-arn"):
        credential_source("tke-pod-identity", {"TKE_REGION": "ap-guangzhou", "TKE_PROVIDER_ID": "cls-abc"})()


@pytest.mark.parametrize("source,env,named", [
    ("tke-pod-identity", {"TKE_REGION": "ap-guangzhou", "TKE_PROVIDER_ID": "cls-abc", "TKE_ROLE_ARN": "qcs::cam::r",
                          "TKE_WEB_IDENTITY_TOKEN_FILE": "/nonexistent/token"}, "TKE_WEB_IDENTITY_TOKEN_FILE"),
    ("tke-pod-identity", {"TKE_REGION": "ap-guangzhou", "TKE_PROVIDER_ID": "cls-abc", "TKE_ROLE_ARN": "qcs::cam::r",
                          "TKE_WEB_IDENTITY_TOKEN_FILE": "{token}", "GTS_STS_ENDPOINT": "http://sts.example.com"},
     "over https only"),
    ("ack-rrsa", {"ALIBABA_CLOUD_ROLE_ARN": "acs:ram::1:role/r", "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": "acs:ram::1:oidc/p",
                  "ALIBABA_CLOUD_OIDC_TOKEN_FILE": "/nonexistent/token"}, "ALIBABA_CLOUD_OIDC_TOKEN_FILE"),
    ("ack-rrsa", {"ALIBABA_CLOUD_ROLE_ARN": "acs:ram::1:role/r", "ALIBABA_CLOUD_OIDC_PROVIDER_ARN": "acs:ram::1:oidc/p",
                  "ALIBABA_CLOUD_OIDC_TOKEN_FILE": "{token}", "ALIBABA_CLOUD_STS_ENDPOINT": "http://10.0.0.9"},
     "over https only")])
def test_a_pods_token_is_never_sent_in_clear_and_a_missing_one_is_named(source: str, env: dict[str, str], named: str,
                                                                        tmp_path: Path) -> None:
    """The pod's token is its identity: a plain-http STS endpoint other than loopback is refused
    before anything is sent, and an unreadable token file is an error naming its variable."""
    from training.cloudmeta import MetadataError
    from training.credentials import credential_source

    token = tmp_path / "token"
    token.write_text("eyJ.token")
    env = {k: v.replace("{token}", str(token)) for k, v in env.items()}
    with pytest.raises(MetadataError, match=named):
        credential_source(source, env)()
