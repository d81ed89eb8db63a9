import sys

from framework.serve.server import main

sys.exit(main())
