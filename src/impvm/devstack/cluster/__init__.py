"""A real multi-node Kubernetes cluster for tests and benchmarks (kubelets with containerd and
runc, CNI, kube-proxy, CoreDNS, kube-scheduler), each node a network namespace of its own.
See :mod:`impvm.devstack.cluster.cluster` and docs/test-cluster.md."""

from impvm.devstack.cluster.cluster import Cluster, ClusterConfig, ClusterError

__all__ = ["Cluster", "ClusterConfig", "ClusterError"]
