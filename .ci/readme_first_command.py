"""Print the README's first quickstart command (first line of the first ```bash block under
"## Quickstart"), so .ci/run runs exactly what a new user copies."""

import re
import sys
from pathlib import Path

readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
block = re.search(r"^```bash\n(.*?)^```", quickstart, re.S | re.M)
if block is None:
    sys.exit("README.md: no ```bash block under ## Quickstart")
print(block.group(1).strip().splitlines()[0])
