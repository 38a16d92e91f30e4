"""Kubernetes plumbing below every component: list+watch caches, Events, the control plane
`impvm up` and the development stack run, and admin helpers (clients, CRDs, bound tokens)."""
