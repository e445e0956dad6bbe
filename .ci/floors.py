"""Prints `name==floor` for each dependency of pyproject.toml whose floor CI tests (a pip constraints file)."""

import re
import sys
import tomllib
from pathlib import Path

TESTED = ("jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "chex")

dependencies = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
floors = {}
for requirement in dependencies:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)", requirement.strip())
    if match and match.group(1) in TESTED:
        floors[match.group(1)] = match.group(3)
missing = [name for name in TESTED if name not in floors]
if missing:
    sys.exit(f"pyproject.toml declares no `>=` floor for {', '.join(missing)}")
print("\n".join(f"{name}=={floors[name]}" for name in TESTED))
