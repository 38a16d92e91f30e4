"""impvm.api."""
