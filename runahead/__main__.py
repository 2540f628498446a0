import sys

from runahead.cli import main

sys.exit(main())
