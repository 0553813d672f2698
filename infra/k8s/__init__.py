"""Cloud-neutral Kubernetes wiring for the GPU pools of EKS, ACK and TKE: node agents (device
plugin, exporters), the training Job, and how node groups become pools."""
