"""pytest plugin: one test per conformance case of a backend.

    pytest -p attnhub.testing.pytest_plugin --attnhub-backend my_backend
    pytest -p attnhub.testing --attnhub-backend my_backend --attnhub-device cuda --attnhub-size large
    pytest -p attnhub.testing --attnhub-backend my_backend --attnhub-sampled 200 --attnhub-seed 7

Inert unless ``--attnhub-backend`` is given (it may be repeated). Test ids read
``attnhub[my_backend-fp16-causal_br-B2H3N77x33D96]``; select with ``-k`` as usual.
``--attnhub-sampled N`` adds N cases drawn at random from the whole call space
(:func:`attnhub.testing.sample_cases`, reproducible from ``--attnhub-seed``). A backend
that declares ``block_sparse`` also gets 12 (and N more) block-sparse cases
(:func:`attnhub.testing.sample_block_sparse_cases`; ids ``my_backend-bs-...``), and
one that declares a serving layout (varlen, kvcache, paged) 12 (and N more) serving
cases (:func:`attnhub.testing.sample_serving_cases`; ids ``my_backend-serve-...``).
Besides the numeric cases, each backend gets a ``repeatable`` test and, where it
declares dropout, a ``dropout`` test; where it declares ``compile_safe``, two of its
cases also run through ``torch.compile(fullgraph=True)`` (ids
``my_backend-compiled-...``). A backend that raises, returns something wrong or
changes its inputs fails the case's test with the kit's one-line report (no traceback
of the backend's exception); one whose cases cannot even be generated gets a single
failing ``cases`` test, and the other backends' tests still run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from .block_sparse import BlockSparseCase, block_sparse_problems, sample_block_sparse_cases
from .cases import Case, cases_for
from .check import (
    BLOCK_SPARSE_CASES,
    SERVING_CASES,
    compiled_cases,
    compiled_problems,
    default_device,
    dropout_problems,
    repeatability_problems,
    run_case,
)
from .faults import describe_exception
from .sampled import sample_cases
from .serving import ServingCase, sample_serving_cases, serving_problems

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
    group.addoption(
        "--attnhub-sampled",
        type=int,
        default=0,
        metavar="N",
        help="also run N cases drawn at random from the whole call space (default 0)",
    )
    group.addoption(
        "--attnhub-seed",
        type=int,
        default=0,
        help="seed of the drawn cases (default 0)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnhub_conformance: a generated attnhub conformance test")


# The checks of one case each, besides the planned and sampled cases: the function that
# lists a case's problems.
_PER_CASE: dict[str, Callable[[str, Any, torch.device], list[str]]] = {
    "block_sparse": block_sparse_problems,
    "serving": serving_problems,
    "compiled": compiled_problems,
}


class ConformanceItem(pytest.Item):
    """One generated check of a backend, by ``check``:

    ``"case"``: the numeric case ``cases[0]``; ``"block_sparse"``: the block-sparse case
    ``cases[0]`` (a :class:`BlockSparseCase`); ``"serving"``: the serving case
    ``cases[0]`` (a :class:`ServingCase`); ``"compiled"``: the numeric case ``cases[0]``
    through ``torch.compile``; ``"repeatable"``: repeatability over
    ``cases``; ``"dropout"``: the dropout checks; ``"cases"``: fails with ``error``, why
    no case could be generated; ``"unavailable"``: skipped.
    """

    def __init__(
        self,
        *,
        backend: str,
        device: torch.device,
        check: str,
        cases: tuple[Case, ...] | tuple[BlockSparseCase, ...] | tuple[ServingCase, ...] = (),
        error: str = "",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.device = device
        self.check = check
        self.cases = cases
        self.error = error
        self.add_marker(pytest.mark.attnhub_conformance)

    @property
    def case(self) -> Case | BlockSparseCase | ServingCase | None:
        return self.cases[0] if self.check == "case" or self.check in _PER_CASE else None

    def runtest(self) -> None:
        if self.check == "case":
            run_case(self.backend, self.cases[0], self.device)  # type: ignore[arg-type]
            return
        if self.check in _PER_CASE:
            case = self.cases[0]
            problems = _PER_CASE[self.check](self.backend, case, self.device)
            if problems:
                raise AssertionError(f"{self.backend} [{case.id}]: " + "; ".join(problems))
            return
        if self.check == "dropout":
            problems = dropout_problems(self.backend, self.device)
        elif self.check == "repeatable":
            problems = repeatability_problems(self.backend, self.cases, self.device)  # type: ignore[arg-type]
        else:
            problems = [self.error]
        if problems:
            raise AssertionError(f"{self.backend}: " + "; ".join(problems))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, AssertionError):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[str, int, str]:
        return (f"attnhub conformance of {self.backend}", 0, self.name)


# One planned item: (check, name suffix, cases, error).
_Check = tuple[
    str, str, tuple[Case, ...] | tuple[BlockSparseCase, ...] | tuple[ServingCase, ...], str
]


def _checks_for(
    name: str,
    cases: list[Case],
    dropout: bool,
    sparse: list[BlockSparseCase],
    serving: list[ServingCase],
    compiled: list[Case],
) -> list[_Check]:
    """A test per case, block-sparse case, serving case and compiled case, repeatability
    over the first case and the first backward case, and the dropout checks where
    dropout is declared (both where a dense case is admitted: they make dense calls)."""
    checks: list[_Check] = [("case", f"{name}-{case.id}", (case,), "") for case in cases]
    checks += [("block_sparse", f"{name}-bs-{c.id}", (c,), "") for c in sparse]
    checks += [("serving", f"{name}-serve-{c.id}", (c,), "") for c in serving]
    checks += [("compiled", f"{name}-compiled-{c.id}", (c,), "") for c in compiled]
    if cases:
        sample = (*cases[:1], *[c for c in cases if c.backward][:1])
        checks.append(("repeatable", f"{name}-repeatable", sample, ""))
        if dropout:
            checks.append(("dropout", f"{name}-dropout", (), ""))
    return checks


def _items_for(session: pytest.Session, name: str) -> list[pytest.Item]:
    from attnhub.registry import get_registry

    config = session.config
    registry = get_registry()
    try:
        backend = registry.get(name)
    except ValueError as exc:  # an unknown name: the message lists the known ones
        raise pytest.UsageError(f"--attnhub-backend {name}: {exc}") from None
    option = config.getoption("attnhub_device")
    device = torch.device(option) if option else default_device(backend)
    unavailable = registry.unavailable_reason(name)
    if unavailable is None and device.type == "cuda" and not torch.cuda.is_available():
        unavailable = "CUDA is not available"
    if unavailable is not None:
        checks: list[_Check] = [("unavailable", f"{name}-unavailable", (), "")]
    else:
        try:
            size = config.getoption("attnhub_size")
            sampled, seed = config.getoption("attnhub_sampled"), config.getoption("attnhub_seed")
            cases = cases_for(backend, device, size=size)
            planned = {case.id for case in cases}
            drawn = sample_cases(backend, device, sampled, seed=seed, size=size)
            cases += [case for case in drawn if case.id not in planned]
            sparse = sample_block_sparse_cases(
                backend, device, BLOCK_SPARSE_CASES + sampled, seed=seed, size=size
            )
            serving = sample_serving_cases(
                backend, device, SERVING_CASES + sampled, seed=seed, size=size
            )
        except Exception as exc:  # the backend's fault: the other backends still collect
            why = f"its conformance cases could not be generated: {describe_exception(exc)}"
            cases, checks = [], [("cases", f"{name}-cases", (), why)]
        else:
            if not cases and not sparse and not serving:
                raise pytest.UsageError(
                    f"--attnhub-backend {name}: its declarations admit no case on {device.type}"
                )
            compiled = compiled_cases(backend, cases, device)
            checks = _checks_for(name, cases, backend.dropout, sparse, serving, compiled)
    items: list[pytest.Item] = []
    for check, suffix, item_cases, error in checks:
        item = ConformanceItem.from_parent(
            session,
            name=f"attnhub[{suffix}]",
            nodeid=f"attnhub[{suffix}]",
            backend=name,
            device=device,
            check=check,
            cases=item_cases,
            error=error,
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
