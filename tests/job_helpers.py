"""What the main job's tests share: the launcher variables a job must not inherit, and the width
every line the job prints must fit."""

from __future__ import annotations

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
COLUMNS = 100


def assert_fits(output: str) -> None:
    """Every line the job printed fits the 100 columns it promises."""
    wide = [line for line in output.splitlines() if len(line) > COLUMNS]
    assert not wide, f"{len(wide)} lines wider than {COLUMNS} columns:\n" + "\n".join(wide)
