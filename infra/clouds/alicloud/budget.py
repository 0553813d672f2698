"""Alibaba Cloud budget alerts. The provider has no budget resource: the stack creates the
CloudMonitor alarm contacts for the budget's e-mails, and the monthly budget itself is set
once in the Billing console (docs/clouds.md, "Budget"); `make plan` shows the cost
against the limit."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_alicloud as alicloud

from infra.model.spec import Budget


@dataclass
class AlicloudBudgetArgs:
    budget: Budget
    env: str


class AlicloudBudget(pulumi.ComponentResource):
    def __init__(self, name: str, args: AlicloudBudgetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:alicloud:Budget", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        contacts = [alicloud.cms.AlarmContact(f"{name}-contact-{i}", alarm_contact_name=f"gts-{args.env}-{i}",
                                              describe=f"budget alerts for {email}", channels_mail=email,
                                              opts=child)
                    for i, email in enumerate(args.budget.alert_emails)]
        self.group = alicloud.cms.AlarmContactGroup(
            f"{name}-contacts", alarm_contact_group_name=f"gpu-training-{args.env}",
            describe=f"GPU training {args.env}: budget {args.budget.monthly_limit_usd:.0f} USD/month",
            contacts=[c.alarm_contact_name for c in contacts], opts=child)
        self.register_outputs({"contactGroup": self.group.alarm_contact_group_name})
