"""The foundations every layer may use: errors, the plan's clock, YAML reading, the GPU catalog
and its data files (infra/data/), physical names and cron schedules. Imports no other layer.

Modules: errors, clock, yamlread, catalog, schedule, names."""
