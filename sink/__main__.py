import sys

from sink.ops.cli import main

sys.exit(main())
