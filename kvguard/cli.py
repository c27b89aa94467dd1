"""``kvguard``: subcommands ``fake-engine``, ``proxy`` and ``demo``.

Each subcommand's module is imported only when it runs, so the proxy needs
no torch.
"""

from __future__ import annotations

import importlib
import sys

# Subcommand -> module with ``main(argv: list[str]) -> int``.
_COMMANDS = {
    "fake-engine": "fake_engine.cli",
    "proxy": "proxy.cli",
    "demo": "kvguard.demo",
}


def main(argv: list[str] | None = None) -> int:
    """Run a subcommand; returns its exit status."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in _COMMANDS:
        names = ", ".join(_COMMANDS)
        print(f"usage: kvguard {{{names}}} [options]", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    module = importlib.import_module(_COMMANDS[args[0]])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
