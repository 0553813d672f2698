"""Tencent Cloud Billing budget: the spec's monthly limit (converted to CNY) over this stack's
resources (its `env` tag) with actual and forecast alerts. The budget API takes no recipients:
they are set once in the console (data/capabilities.yaml, budgetRecipients)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

import pulumi
import tencentcloud_iac_pulumi as tencentcloud

from infra.model.spec import Budget


@dataclass
class TencentBudgetArgs:
    budget: Budget
    env: str
    cny_per_usd: float
    account_settings: bool  # make `env` a cost allocation tag (once per account)


def budget_period(now: datetime | None = None) -> tuple[str, str]:
    """From this month for a year (YYYY-MM); taken once, later runs ignore it."""
    now = now or datetime.now(timezone.utc)
    end_month = now.month - 1 + 11
    return f"{now.year}-{now.month:02d}", f"{now.year + end_month // 12}-{end_month % 12 + 1:02d}"


class TencentBudget(pulumi.ComponentResource):
    def __init__(self, name: str, args: TencentBudgetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:tencentcloud:Budget", name, None, opts)
        b = args.budget
        begin, end = budget_period()
        warn = tencentcloud.billing.BudgetWarnJsonArgs
        alerts = [warn(cal_type="PERCENTAGE", threshold_value=str(p), warn_type="ACTUAL") for p in b.thresholds_percent]
        alerts.append(warn(cal_type="PERCENTAGE", threshold_value="100", warn_type="FORECAST"))
        child = pulumi.ResourceOptions(parent=self)
        depends: list[pulumi.Resource] = []
        if args.account_settings:
            # A budget can filter only on cost allocation tags (tencentcloud billing_allocation_tag doc).
            depends.append(tencentcloud.billing.AllocationTag(f"{name}-env-tag", tag_key="env", opts=child))
        self.budget = tencentcloud.billing.Budget(
            f"{name}-monthly", budget_name=f"gpu-training-{args.env}", bill_type="BILL", fee_type="COST",
            cycle_type="MONTH", plan_type="FIX", budget_quota=f"{b.monthly_limit_usd * args.cny_per_usd:.2f}",
            period_begin=begin, period_end=end, warn_jsons=alerts,
            # Only this stack's spend, as the AWS budget filters on the same tag.
            dimensions_range=tencentcloud.billing.BudgetDimensionsRangeArgs(tags=[
                tencentcloud.billing.BudgetDimensionsRangeTagArgs(tag_key="env", tag_values=[args.env])]),
            budget_note=f"{b.monthly_limit_usd:.0f} USD/month; set alert recipients in the console: "
                        f"{', '.join(b.alert_emails)}",
            opts=pulumi.ResourceOptions(parent=self, depends_on=depends, ignore_changes=["periodBegin", "periodEnd"]))
        self.register_outputs({"budgetName": self.budget.budget_name})
