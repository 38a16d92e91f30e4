"""The read-only commands of the `impvm` CLI: `impvm status`, `impvm logs`, and the generator of
docs/configuration.md."""
