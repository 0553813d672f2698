"""Stacks for many teams: the registry (teams.yaml), the stacks generated from it, the queues
on the shared clusters, `make teams` (report) and the Automation API driver (`python -m
infra.teams preview|up|destroy`)."""
