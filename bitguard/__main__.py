import sys

from bitguard.cli import main

sys.exit(main())
