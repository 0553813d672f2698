"""Prices per region: their age (age.py) and `make prices` (refresh.py), which refreshes
infra/data/prices.csv from the clouds' own price sources (sources.py)."""
