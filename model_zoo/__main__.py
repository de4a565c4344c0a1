"""`python -m model_zoo` runs the `model-zoo` command."""

from model_zoo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
