"""AWS Budgets: the stack's monthly limit, with actual and forecast alerts by e-mail."""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.model.spec import Budget


@dataclass
class AwsBudgetArgs:
    budget: Budget
    env: str
    tags: dict[str, str]
    account_settings: bool  # activate `env` as a cost allocation tag (once per account)


class AwsBudget(pulumi.ComponentResource):
    def __init__(self, name: str, args: AwsBudgetArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-training-stack:aws:Budget", name, None, opts)
        b = args.budget
        notifications = [aws.budgets.BudgetNotificationArgs(
            comparison_operator="GREATER_THAN", notification_type="ACTUAL", threshold=pct,
            threshold_type="PERCENTAGE", subscriber_email_addresses=b.alert_emails) for pct in b.thresholds_percent]
        notifications.append(aws.budgets.BudgetNotificationArgs(
            comparison_operator="GREATER_THAN", notification_type="FORECASTED", threshold=100,
            threshold_type="PERCENTAGE", subscriber_email_addresses=b.alert_emails))
        child = pulumi.ResourceOptions(parent=self)
        depends: list[pulumi.Resource] = []
        if args.account_settings:
            # The budget's TagKeyValue filter counts only activated cost allocation tags.
            depends.append(aws.costexplorer.CostAllocationTag(f"{name}-env-tag", tag_key="env", status="Active",
                                                              opts=child))
        self.budget = aws.budgets.Budget(
            f"{name}-monthly", name=f"gpu-training-{args.env}", budget_type="COST", time_unit="MONTHLY",
            limit_amount=f"{b.monthly_limit_usd:.2f}", limit_unit="USD",
            # Only this stack's spend: its env tag (activated as a cost allocation tag above, by
            # the one stack per account that has clouds.aws.accountSettings).
            cost_filters=[aws.budgets.BudgetCostFilterArgs(name="TagKeyValue", values=[f"user:env${args.env}"])],
            notifications=notifications, tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=depends))
        self.register_outputs({"budgetName": self.budget.name})
