"""`python -m keras_fastloop_cli`: the `keras-fastloop` command."""

import sys

from keras_fastloop_cli import main

sys.exit(main())
