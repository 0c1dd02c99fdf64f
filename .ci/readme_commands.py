"""The README's two commands, read from its first ```bash block, so that CI runs the test command
exactly as a newcomer pastes it (the two cannot drift apart).

    python3 .ci/readme_commands.py main   # set up + the main job
    python3 .ci/readme_commands.py test   # set up + lint + tests: what .ci/run runs

Each line of the block is `COMMAND   # comment`; the command is what precedes the comment. A README
whose block is missing, or does not hold exactly the two commands in that order, is an error here,
so CI fails rather than run something else.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
ROLES = ("main", "test")


def readme_commands(readme: Path = README) -> dict[str, str]:
    """``{"main": ..., "test": ...}`` from the README's first ```bash block."""
    block = re.search(r"^```bash\n(.*?)^```", readme.read_text(), re.M | re.S)
    if block is None:
        raise ValueError(f"{readme}: no ```bash block holding the two commands")
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    if len(lines) != 2:
        raise ValueError(f"{readme}: the first ```bash block must hold exactly 2 commands, it holds {len(lines)}")
    commands = dict(zip(ROLES, (line.split("  #", 1)[0].strip() for line in lines)))
    if "vibetrain generate" not in commands["main"]:
        raise ValueError(f"{readme}: the first command must run `vibetrain generate`: {commands['main']!r}")
    if not commands["test"].split("&&")[-1].strip().startswith("pytest"):
        raise ValueError(f"{readme}: the second command must end by running `pytest`: {commands['test']!r}")
    return commands


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ROLES:
        sys.exit(f"usage: python3 {sys.argv[0]} {{{'|'.join(ROLES)}}}")
    try:
        print(readme_commands()[sys.argv[1]])
    except ValueError as error:
        sys.exit(f"readme_commands: {error}")
