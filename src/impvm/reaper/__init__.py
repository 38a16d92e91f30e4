"""impvm.reaper."""
