import sys

from bench.stress.attacks import main

sys.exit(main())
