"""impvm: ephemeral GitHub Actions runners, one microVM per job, on Kubernetes."""

__version__ = "0.1.0"
