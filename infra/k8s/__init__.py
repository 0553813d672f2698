"""Cloud-neutral Kubernetes wiring for the GPU pools of EKS, ACK and TKE: node agents (device
plugin, exporters) and the training Job. The pod's shape as plain data is infra/pods.py, how node
groups become pools infra/model/pools.py (the checks read both without loading Pulumi)."""
