"""`python -m tapd.settings [--markdown]`: the settings, or docs/SETTINGS.md's table of them."""

import argparse
import sys

from tapd.settings import SETTINGS
from tapd.settings.markdown import markdown_table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tapd.settings", description="tapd's settings")
    parser.add_argument("--markdown", action="store_true", help="print docs/SETTINGS.md's table")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown_table())
    else:
        for setting in SETTINGS:
            print(f"{setting.variable or '-':<24} {setting.name:<22} {setting.shown_default}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
