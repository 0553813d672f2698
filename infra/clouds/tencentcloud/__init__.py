"""Tencent Cloud: VPC, CVM/AS GPU fleet, TKE GPU pools, COS, CAM and billing components."""
