"""gpu-training-stack: Pulumi components, stack spec, GPU catalog and cost model."""
