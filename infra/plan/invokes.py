"""Answers for the provider functions (invokes) the stack program calls, for the mock engine.

Any invoke without an entry here fails the plan loudly, so a new data-source call cannot slip
through with a made-up answer. Values mirror the shape of the real responses.
"""

from __future__ import annotations

from typing import Any

from infra.plan.engine import InvokeHandler


def _aws_ssm_parameter(args: dict[str, Any]) -> dict[str, Any]:
    name = str(args["name"])
    return {"id": name, "name": name, "type": "String", "value": "ami-0123456789abcdef0",
            "insecureValue": "ami-0123456789abcdef0", "arn": f"arn:aws:ssm:::parameter{name}",
            "version": 1, "withDecryption": True}


def _aws_caller_identity(args: dict[str, Any]) -> dict[str, Any]:
    return {"accountId": "123456789012", "arn": "arn:aws:iam::123456789012:user/plan",
            "id": "123456789012", "userId": "AIDAPLAN"}


def _aws_partition(args: dict[str, Any]) -> dict[str, Any]:
    return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws",
            "reverseDnsPrefix": "com.amazonaws"}


INVOKES: dict[str, InvokeHandler] = {
    "aws:ssm/getParameter:getParameter": _aws_ssm_parameter,
    "aws:index/getCallerIdentity:getCallerIdentity": _aws_caller_identity,
    "aws:index/getPartition:getPartition": _aws_partition,
}
