import sys

from tapd.cli.main import main

sys.exit(main())
