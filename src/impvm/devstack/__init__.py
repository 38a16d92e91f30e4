"""impvm.devstack."""
