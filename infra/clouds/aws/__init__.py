"""AWS: network, GPU fleet, EKS GPU pools, S3, IAM and budget components."""
