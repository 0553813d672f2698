"""What a stack spec's string values may look like: the patterns its fields are checked with and,
for each, the help a user reads when a value does not match (infra/model/spec_problems.py). Names are
importable from infra.model.spec as well."""

from __future__ import annotations

import re

NAME_PATTERN = r"^[a-z][a-z0-9-]{0,30}[a-z0-9]$"
NO_NUL = r"^[^\x00]*$"
# Values that reach /etc/gpu-training/node.env, which the node's scripts source as root, systemd
# reads as an EnvironmentFile= and docker as an --env-file: only characters all three read as
# themselves, unquoted (no quotes, spaces, `$`, backquotes, `;`, `&`, `|`, `\\`, `~`, `#`, newlines).
ENV_SAFE = r"A-Za-z0-9._/:@%+,=-"
# An http(s) mirror: host, port, path; no credentials (they would sit in user data in clear).
MIRROR_URL = r"^https?://[A-Za-z0-9.-]+(:[0-9]+)?(/[A-Za-z0-9._/%+,=:@-]*)?$"
# What the offline plan reads for a `secure:` value (it cannot decrypt it); the real program
# reads the decrypted value, which the patterns then check.
SECRET_MASK = "[secret]"
# MLflow's tracking URI: databricks, or scheme://host[:port][/path] (file:///, http(s)://, sqlite:///).
TRACKING_URI = r"^(\[secret\]|databricks(-uc)?|[a-z][a-z0-9+.-]*://[A-Za-z0-9.-]*(:[0-9]+)?(/[A-Za-z0-9._/%+,=:@-]*)?)$"
# scheme://user:password@ — a password in a URL (refused in clear in a stack file, never echoed).
URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:]*:[^/?#@\s]+@")
REGISTRY_HOST = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9._-]+)*$"
# A container image reference (docker/distribution reference grammar, lowercase repository).
IMAGE_REF = r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9._-]+)*(:[A-Za-z0-9_.-]{1,128})?(@sha256:[0-9a-f]{64})?$"
# A mail address a cloud's budget service takes and no shell or template reads otherwise (it reaches
# budget notifications and tags): RFC 5321's common dot-atom local part, a dotted host.
EMAIL = r"^[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)*\.([A-Za-z]{2,}|xn--[A-Za-z0-9-]+)$"  # xn--: punycode
# A file of the project: relative, no `..` (no part starts with a dot), no leading `/` (kubernetes.queues).
PROJECT_YAML = r"^([A-Za-z0-9_-][A-Za-z0-9._-]*/)*[A-Za-z0-9_-][A-Za-z0-9._-]*\.ya?ml$"
PATTERN_HELP = {
    EMAIL: "use a plain address such as ml-team@example.com (letters, digits, . _ % + - before the @)",
    PROJECT_YAML: "use a path relative to the project (e.g. teams.yaml), without `..`, a leading / or a part starting with a dot",
    MIRROR_URL: "use an http(s) URL: scheme, host, optional port and path, without credentials or characters a "
                "shell would read (the value is written to the nodes' env file)",
    TRACKING_URI: "use databricks or scheme://host[:port]/path without credentials (MLflow reads "
                  "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for those) or characters a shell would read",
    REGISTRY_HOST: "use a registry host with optional port and path, e.g. registry.cn-hangzhou.aliyuncs.com",
    IMAGE_REF: "use an image reference: registry/repository[:tag]@sha256:<digest>, lowercase repository",
    NO_NUL: "an argument cannot hold a NUL character (the launcher would split it in two)",
    NAME_PATTERN: "use 2-32 lowercase letters, digits and hyphens, starting with a letter",
    r"^\d{10}$": "use the 10-digit APPID from the Tencent Cloud console, quoted (appId: \"1250000000\")",
}
