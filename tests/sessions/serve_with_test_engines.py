"""`omniduplex` with the session tests' engines registered (for servers run as a subprocess).

python -m tests.sessions.serve_with_test_engines serve --pipeline tests/sessions/history_echo.yaml ...
"""

from __future__ import annotations

import sys

from tests.sessions.history_engine import register
from web.cli import main

if __name__ == "__main__":
    register()
    raise SystemExit(main(sys.argv[1:]))
