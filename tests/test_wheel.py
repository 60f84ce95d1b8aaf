"""The wheel: every package in it, nothing generic at the top of site-packages, and a working
install (configs, the shipped database, both commands) with no checkout in sight."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _packages(top: Path, name: str) -> set[str]:
    """Dotted names of `top` and every package below it (folders with an __init__.py)."""
    return {".".join([name, *d.relative_to(top).parts]) for d in [top, *top.rglob("*")]
            if d.is_dir() and (d / "__init__.py").is_file()}


def test_every_package_of_the_source_is_in_the_wheel():
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    expected = (_packages(ROOT / "tileops", "tileops") | _packages(ROOT / "tuner", "tileops.tuner")
                | {"tileops._data.configs", "tileops._data.tuning_db"})
    assert listed == expected  # a new ops/<op>/ must be listed in pyproject.toml
    assert setuptools["package-dir"]["tileops.tuner"] == "tuner"


def test_the_wheel_installs_a_working_tileops(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--disable-pip-version-check", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("tileops-*.whl")
    env_dir = tmp_path / "venv"
    # The dependencies (torch, TileLang, Optuna) come from this interpreter's site-packages; the
    # venv's own holds the wheel only, and comes first.
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--no-deps", "--no-index", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, text=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], check=True, capture_output=True,
                               text=True).stdout.strip())
    assert sorted(p.name for p in site.iterdir() if not p.name.endswith(".dist-info")
                  and not p.name.startswith(("_", "."))) == ["tileops"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TILEOPS_USER_DB"] = str(tmp_path / "user.sqlite")

    def run(*argv: str) -> str:
        done = subprocess.run([str(python), *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
        return done.stdout

    where = run("-c", "import tileops, tileops.tuner.cli; from tileops.resources import data_dir;"
                      "print(tileops.__file__, data_dir('configs'), data_dir('tuning_db'))")
    assert all(str(site) in path for path in where.split())
    run("-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('tuner') is not None)")
    bin_dir = env_dir / "bin"
    assert "gemm" in run(str(bin_dir / "tileops"), "ops")
    assert (site / "tileops" / "native" / "warm.cc").is_file()  # the native warm path's source
    shipped = site / "tileops" / "_data" / "tuning_db" / "h200.sqlite"
    assert "NVIDIA H200" in run(str(bin_dir / "tileops"), "db", "summary", "--db", str(shipped))
    assert "pass the checks" in run(str(bin_dir / "tileops-tune"), "--device", "cpu", "--op",
                                    "gemm", "--shape=16x64x64", "--dtype", "float32",
                                    "--dry-run")
