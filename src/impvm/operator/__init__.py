"""impvm.operator."""
