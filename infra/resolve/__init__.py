"""The resolved stack: each node group with its cloud's answers (resolved, groups), its fabric,
shared file systems, bucket and grants, the trainer contract, the rendezvous store, spares,
the pod's shape and the cost. Imports model and core; no Pulumi resource code.

Modules: buckets, fabric, fabric_plan, resolved, contract, groups, rendezvous, spares, sharedfs, access, pods, gpu_health, cost."""
