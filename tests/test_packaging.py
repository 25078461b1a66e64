"""The built wheel: one top-level name, and it runs without the source checkout.

The folders ``services/``, ``projections/`` and ``schemas/`` stay at the project's root and the build
maps them into ``dagfold`` (pyproject.toml's package-dir). Before, the wheel installed top-level
packages named ``services`` and ``projections`` (names any other project may own) and no schemas,
so an installed dagfold could not decode a record.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of the checkout's files (tracked, and new ones git does not ignore): setuptools' build/
    # folder in the checkout keeps modules of earlier builds, deleted or left out since, and would hide both
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        f = ROOT / name
        if f.is_file() and not f.is_symlink():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, src / name)
    for link in ("dagfold/services", "dagfold/projections"):  # the checkout's links, as links
        (src / link).unlink(missing_ok=True)
        (src / link).symlink_to(Path("..") / Path(link).name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
                   check=True, timeout=300, capture_output=True)
    (found,) = out.glob("dagfold-*.whl")
    return found


def test_the_wheel_installs_one_top_level_name_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"dagfold"}
    assert "dagfold/services/scheduler/fold.py" in names
    assert "dagfold/projections/jobs.py" in names
    assert "dagfold/services/api/static/app.js" in names
    assert "dagfold/schemas/dagfold.command.SubmitJob.avsc" in names
    schemas = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "schemas").rglob("*.avsc"))
    assert sorted(n.replace("dagfold/", "", 1) for n in names if n.endswith(".avsc")) == schemas
    assert "dagfold/py.typed" in names
    # every module of the checkout is in the wheel (a package missing from pyproject.toml's list is left out
    # silently: services/tracing was, until a module imported at start-up showed it)
    wanted = {f"dagfold/{p.relative_to(ROOT / 'dagfold').as_posix()}" for p in (ROOT / "dagfold").rglob("*.py")
              if "services" not in p.relative_to(ROOT / "dagfold").parts[:1]
              and "projections" not in p.relative_to(ROOT / "dagfold").parts[:1]}
    wanted |= {f"dagfold/{p.relative_to(ROOT).as_posix()}" for top in ("services", "projections")
               for p in (ROOT / top).rglob("*.py")}
    missing = sorted(n for n in wanted - set(names) if "__pycache__" not in n)
    assert not missing, f"left out of the wheel (pyproject.toml's packages): {missing}"


def test_the_unpacked_wheel_runs_without_the_checkout(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import dagfold, dagfold.codec as c, dagfold.services.scheduler.fold as f, dagfold.projections.jobs as j\n"
        "from dagfold.services.api.app import STATIC\n"
        "for m in (dagfold, c, f, j):\n"
        "    assert m.__file__.startswith(SITE), m.__file__\n"
        "assert c.SCHEMA_DIR.is_relative_to(SITE), c.SCHEMA_DIR\n"
        "assert c.Codec().names(), 'no schemas'\n"
        "assert (STATIC / 'index.html').is_file()\n"
    )
    # Run from an empty folder with only the unpacked wheel first on the path: nothing of the checkout.
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", f"SITE = {str(site)!r}\n" + probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
