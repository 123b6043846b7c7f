"""``python -m elastic_train`` (also under ``torchrun ... -m elastic_train``)."""

import sys

from elastic_train.cli import main

if __name__ == "__main__":
    sys.exit(main())
