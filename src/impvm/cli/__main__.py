"""``python -m impvm.cli``: the ``impvm`` command (how ``impvm up`` starts its processes)."""

from impvm.cli import app

if __name__ == "__main__":  # pragma: no cover
    app()
