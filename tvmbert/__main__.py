import sys

from tvmbert.cli import main

sys.exit(main())
