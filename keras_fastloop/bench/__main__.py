"""`python -m keras_fastloop.bench` == `keras-fastloop bench`."""

import sys

from keras_fastloop.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
