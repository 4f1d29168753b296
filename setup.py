"""Maps the monorepo's folders onto one import tree.

`libs/inferplane` is the package `inferplane`; each deployable service under `services/<name>/`
is the subpackage `inferplane.<name>` (`node-agent` -> `inferplane.node_agent`). Metadata lives
in pyproject.toml; only this mapping needs code.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent


def _packages() -> tuple[list[str], dict[str, str]]:
    roots = {"inferplane": "libs/inferplane"}
    for service in sorted((ROOT / "services").iterdir()):
        if (service / "__init__.py").exists():
            roots["inferplane." + service.name.replace("-", "_")] = f"services/{service.name}"
    packages: list[str] = []
    for name, folder in roots.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            if "tests" in rel.parts:
                continue
            packages.append(".".join([name, *rel.parts]))
    return packages, roots


packages, package_dir = _packages()
setup(
    packages=packages,
    package_dir=package_dir,
    include_package_data=True,
    # Alembic environments (services/<name>/migrations/): env.py and versions/ ship as modules;
    # the revision template and the developers' alembic.ini are data.
    package_data={"": ["migrations/script.py.mako", "migrations/alembic.ini"]},
)
