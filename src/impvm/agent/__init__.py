"""impvm.agent."""
