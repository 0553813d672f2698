"""What the stack writes for nodes and clouds: the user data and the node agents' settings, the
node bundle, the trainer image, monitoring, and which resources are protected. infra/k8s (the
Kubernetes objects) sits beside it. Imports checks and below.

Modules: node_settings, bundle, protection.
Of this layer but still at infra/ root (bytes a plan hashes name their paths: tools/relayer.py
PINNED): userdata, image, monitoring."""
