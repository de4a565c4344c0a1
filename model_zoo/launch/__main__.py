"""`python -m model_zoo.launch --workers N -- COMMAND`: see `model_zoo.launch.local`."""

import sys

from model_zoo.launch.local import main

if __name__ == "__main__":
    sys.exit(main())
