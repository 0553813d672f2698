"""The gpu-training-stack policy pack. Rules live in importable modules; `__main__.py` only
builds the PolicyPack (importing it starts the policy gRPC server, so nothing else may)."""
