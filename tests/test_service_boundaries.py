"""Services never import each other: shared rules live in services/common, which imports no
service. (The launcher, which starts the services, and the tasks library may use them.)"""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = ("retriever", "rollout", "scorer", "learner")
ROOT = Path(__file__).resolve().parents[1] / "services"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def crossings(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / package).rglob("*.py")):
        for module in imported_modules(path):
            parts = module.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] in forbidden \
                    and parts[1] != package:
                bad.append(f"{path.relative_to(root.parent)} imports {module}")
    return bad


def test_no_service_imports_another():
    bad = [line for service in SERVICES for line in crossings(service, SERVICES)]
    assert not bad, "services import each other (move the shared rule to services/common):\n" \
        + "\n".join(bad)


def test_common_imports_no_service():
    bad = crossings("common", (*SERVICES, "launch", "tasks"))
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_crossing(tmp_path):
    fake = tmp_path / "services"
    (fake / "learner").mkdir(parents=True)
    (fake / "learner" / "x.py").write_text(
        "def f():\n    from services.scorer.rewards.probe import overconfidence\n")
    assert crossings("learner", SERVICES, fake) == [
        "services/learner/x.py imports services.scorer.rewards.probe"]
