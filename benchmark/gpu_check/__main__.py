import sys

from benchmark.gpu_check.cli import main

sys.exit(main())
