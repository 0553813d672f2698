"""The resolved stack: each node group with its cloud's answers (resolved, groups), its fabric,
shared file systems, bucket and grants, the trainer contract, the rendezvous store, spares,
the pod's shape and the cost. Imports model and core; no Pulumi resource code.

Modules: fabric_plan, resolved, groups, spares, sharedfs, access, gpu_health, cost.
Of this layer but still at infra/ root (bytes a plan hashes name their paths: tools/relayer.py
PINNED): buckets, fabric, contract, rendezvous, pods."""
