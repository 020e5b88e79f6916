"""`python -m keras_fastloop_bench` == `keras-fastloop bench`."""

import sys

from keras_fastloop_cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
