"""A picture of a terminal's text: what a command printed (saved with `| tee out.txt`), drawn as an SVG page
by rich, for the README.

    minigrpo train | tee first_run.txt
    python scripts/screen_svg.py first_run.txt --out docs/images/first_run.svg --title "minigrpo train"
"""

import argparse
from pathlib import Path

from rich.console import Console
from rich.text import Text

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("text", help="the saved output")
parser.add_argument("--out", required=True)
parser.add_argument("--title", default="minigrpo")
parser.add_argument("--width", type=int, default=118)
args = parser.parse_args()

if Path(args.out).exists():
    raise SystemExit(f"{args.out} is there already; give another --out")
console = Console(record=True, width=args.width, file=open("/dev/null", "w"), force_terminal=True)
console.print(Text.from_ansi(Path(args.text).read_text()), soft_wrap=True)
console.save_svg(args.out, title=args.title)
print(f"wrote {args.out}")
