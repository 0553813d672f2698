"""Offline plan: the real stack program in Pulumi's mock engine, no CLI, credentials or network."""
