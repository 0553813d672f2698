"""Alibaba Cloud: VPC, ECS/ESS GPU fleet, ACK GPU pools, OSS, RAM and CloudMonitor components."""
