"""pytest plugin: one test per conformance case of a backend.

    pytest -p attnhub.testing.pytest_plugin --attnhub-backend my_backend
    pytest -p attnhub.testing --attnhub-backend my_backend --attnhub-device cuda --attnhub-size large

Inert unless ``--attnhub-backend`` is given (it may be repeated). Test ids read
``attnhub[my_backend-fp16-causal_br-B2H3N77x33D96]``; select with ``-k`` as usual.
Besides the numeric cases, each backend gets a ``repeatable`` test and, where it
declares dropout, a ``dropout`` test.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from .cases import Case, cases_for
from .check import default_device, dropout_problems, repeatability_problems, run_case

SIZES = ("tiny", "small", "large")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnhub", "attnhub conformance kit")
    group.addoption(
        "--attnhub-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the attnhub conformance suite against this registered backend (repeatable)",
    )
    group.addoption(
        "--attnhub-device",
        default=None,
        help="device for the conformance suite (default: cuda if the backend runs there "
        "and a GPU is present, else cpu)",
    )
    group.addoption(
        "--attnhub-size",
        default="small",
        choices=SIZES,
        help="case sizes: tiny (Triton interpreter), small (CPU, default), large (GPU)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnhub_conformance: a generated attnhub conformance test")


class ConformanceItem(pytest.Item):
    """One generated check: a numeric case, the dropout checks or repeatability."""

    def __init__(
        self, *, backend: str, device: torch.device, check: str, case: Case | None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.device = device
        self.check = check
        self.case = case
        self.add_marker(pytest.mark.attnhub_conformance)

    def runtest(self) -> None:
        if self.check == "case":
            assert self.case is not None
            run_case(self.backend, self.case, self.device)
            return
        if self.check == "dropout":
            problems = dropout_problems(self.backend, self.device)
        else:
            cases = cases_for(self.backend, self.device, size=self.config.getoption("attnhub_size"))
            sample = cases[:1] + [c for c in cases if c.backward][:1]
            problems = repeatability_problems(self.backend, sample, self.device)
        if problems:
            raise AssertionError(f"{self.backend}: " + "; ".join(problems))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, AssertionError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return (f"attnhub conformance of {self.backend}", 0, self.name)


def _items_for(session: pytest.Session, name: str) -> list[pytest.Item]:
    from attnhub.registry import get_registry

    config = session.config
    registry = get_registry()
    backend = registry.get(name)  # unknown name: ValueError listing the known ones
    option = config.getoption("attnhub_device")
    device = torch.device(option) if option else default_device(backend)
    unavailable = registry.unavailable_reason(name)
    if unavailable is None and device.type == "cuda" and not torch.cuda.is_available():
        unavailable = "CUDA is not available"
    checks: list[tuple[str, str, Case | None]] = []
    if unavailable is None:
        cases = cases_for(backend, device, size=config.getoption("attnhub_size"))
        if not cases:
            raise pytest.UsageError(
                f"--attnhub-backend {name}: its declarations admit no case on {device.type}"
            )
        checks = [("case", f"{name}-{case.id}", case) for case in cases]
        checks.append(("repeatable", f"{name}-repeatable", None))
        if backend.dropout:
            checks.append(("dropout", f"{name}-dropout", None))
    else:
        checks = [("unavailable", f"{name}-unavailable", None)]
    items: list[pytest.Item] = []
    for check, item_name, case in checks:
        item = ConformanceItem.from_parent(
            session,
            name=f"attnhub[{item_name}]",
            nodeid=f"attnhub[{item_name}]",
            backend=name,
            device=device,
            check=check,
            case=case,
        )
        if check == "unavailable":
            item.add_marker(pytest.mark.skip(reason=f"{name} is unavailable here: {unavailable}"))
        items.append(item)
    return items


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    # tryfirst: the generated items exist before -k / -m deselect.
    for name in config.getoption("attnhub_backend", default=[]) or []:
        items.extend(_items_for(session, name))
